"""Prompts from parquet files in upstream verl's RLHFDataset format, tokenized once on the driver.

One row per prompt, with upstream's columns: the chat messages under ``data.prompt_key`` (``[{"role", "content"},
...]``), ``data_source`` (or ``data.reward_fn_key``: it picks the reward rule), ``reward_model.ground_truth`` and
an optional ``extra_info`` dict. A user's files and the embedded task (written as such a file first) take the
same path, so the default run exercises what a user's run does.

Prompt text is the tokenizer's chat template with the generation prompt, as upstream; a tokenizer without a
template (the embedded character-level one) gets the messages' contents joined by newlines instead of
transformers' error. Prompts longer than ``data.max_prompt_length`` are dropped (``filter_overlong_prompts``)
or truncated as upstream's ``truncation`` says (``left`` keeps the end, ``right`` the start, ``middle`` both
halves; ``error`` refuses the file naming the row). The template runs in a bounded child process
(``verl.utils.dataset.chat_template``), and a prompt longer in characters than ``max_prompt_length`` tokens can
spell (``max_prompt_chars``) takes the length rule without being tokenized whole, and a file whose prompt text
is larger uncompressed than its rows can use is refused from its metadata before it is decompressed
(``oversized_prompt_problems``).

Only the schema check (``parquet_problems``) runs before the ranks start; it needs pyarrow, not torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from verl.utils.dataset.chat_template import Rendered, TemplateError, render_prompts
from verl.utils.one_line import shown

TRUNCATIONS = ("error", "left", "right", "middle")


def as_file_list(files: str | Iterable[str] | None) -> list[str]:
    """``data.train_files`` as a list of expanded paths (Hydra gives a string or a list)."""
    if files is None:
        return []
    items = [files] if isinstance(files, str) else list(files)
    return [os.path.abspath(os.path.expanduser(str(item))) for item in items]


def parquet_problems(files: Sequence[str], key: str, prompt_key: str, reward_fn_key: str) -> list[str]:
    """One line per file that is missing, unreadable as parquet or lacks a column the trainer reads.

    Reads only each file's schema, so a wrong path or column fails the pre-start check in a moment.
    """
    import pyarrow.parquet as pq

    problems = []
    for path in files:
        if not os.path.isfile(path):
            problems.append(f"{key}: {path} does not exist; point {key} at parquet files in RLHFDataset's format")
            continue
        try:
            names = set(pq.read_schema(path).names)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a non-parquet file
            problems.append(f"{key}: {path} is not a readable parquet file ({type(exc).__name__}: {exc})")
            continue
        missing = [column for column in (prompt_key, reward_fn_key, "reward_model") if column not in names]
        if missing:
            problems.append(
                f"{key}: {path} has no column {missing} (it has {sorted(names)}); RLHFDataset's format needs the "
                f"chat messages under data.prompt_key={prompt_key}, data.reward_fn_key={reward_fn_key} and "
                "reward_model.ground_truth"
            )
    return problems


# Reading a parquet file decompresses it whole, so the prompt text of each row group is sized from the file's
# metadata first: a row group may hold what its rows can use under the length rule (``max_prompt_chars`` each,
# in UTF-8, plus the messages' roles and structure), or ``PROMPT_BYTES_READ_ANYWAY`` when that is more (a row
# group of a few long prompts is read whole, so the length rule can drop or cut them row by row). A few KB of
# zstd can hold gigabytes of one repeated character.
PROMPT_BYTES_READ_ANYWAY = 64 << 20
UTF8_BYTES_PER_CHAR = 4
MESSAGE_BYTES_PER_ROW = 4096


def oversized_prompt_problems(files: Sequence[str], prompt_key: str, max_chars: int, key: str, max_samples: int = -1) -> list[str]:
    """One line per row group of ``files`` whose prompt text is larger, uncompressed, than its rows can use
    (see PROMPT_BYTES_READ_ANYWAY); read from the files' metadata only, nothing is decompressed."""
    import pyarrow.parquet as pq

    problems = []
    remaining = max_samples if max_samples and max_samples > 0 else None
    for path in files:
        metadata = pq.read_metadata(path)
        first = 0
        for number in range(metadata.num_row_groups):
            if remaining is not None and first >= remaining:
                break
            group = metadata.row_group(number)
            columns = [group.column(c) for c in range(group.num_columns)]
            size = sum(c.total_uncompressed_size for c in columns if c.path_in_schema == prompt_key or c.path_in_schema.startswith(f"{prompt_key}."))
            allowed = max(group.num_rows * (max_chars * UTF8_BYTES_PER_CHAR + MESSAGE_BYTES_PER_ROW), PROMPT_BYTES_READ_ANYWAY)
            if size > allowed:
                problems.append(
                    f"{key}: {path} rows {first}..{first + group.num_rows - 1} hold {size} bytes of prompt text uncompressed, more than "
                    f"{group.num_rows} prompt(s) of at most {max_chars} characters can use ({allowed} bytes read at most): a prompt there "
                    "is far over data.max_prompt_length and is not read; remove or shorten it"
                )
            first += group.num_rows
        if remaining is not None:
            remaining -= first
    return problems


def read_parquet_rows(files: Sequence[str], max_samples: int = -1) -> list[dict]:
    """Every row of ``files`` in order, as plain dicts; ``max_samples > 0`` keeps the first that many."""
    import pyarrow.parquet as pq

    rows: list[dict] = []
    for path in files:
        rows.extend(pq.read_table(path).to_pylist())
    return rows[:max_samples] if max_samples and max_samples > 0 else rows


def write_rlhf_parquet(rows: Sequence[Mapping[str, Any]], path: str) -> str:
    """Write ``rows`` (RLHFDataset's columns) to ``path`` atomically: a concurrent reader sees all or nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    pq.write_table(pa.Table.from_pylist([dict(row) for row in rows]), tmp)
    os.replace(tmp, path)
    return path


# A token covers at most as many characters as its longest vocabulary entry spells (a byte-level entry spells
# each byte it covers with one character, so never fewer than the characters); twice that leaves room for a
# normalizer that folds a few characters into one. A prompt over max_prompt_length x this many characters per
# token can never fit in max_prompt_length tokens, so the length rule takes it without tokenizing it whole.
CHARS_PER_TOKEN_MARGIN = 2


def check_messages(messages: Any) -> None:
    """ValueError unless ``messages`` is a list of chat messages ``{role, content}``."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) and "content" in m for m in messages):
        raise ValueError(f"a prompt must be a list of chat messages {{role, content}}, got {shown(messages)}")


def max_prompt_chars(tokenizer: Any, max_length: int) -> int:
    """The most characters a prompt of ``max_length`` tokens can have with ``tokenizer`` (see CHARS_PER_TOKEN_MARGIN)."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_length * max(longest, 1) * CHARS_PER_TOKEN_MARGIN


def _joined(prompts: Sequence[Any], max_chars: int) -> Iterable[Rendered]:
    """A tokenizer without a template: each prompt's contents joined by newlines (no template code runs)."""
    for messages in prompts:
        text = "\n".join(str(m["content"]) for m in messages)
        yield Rendered.of(text, max_chars)


def truncate(ids: list[int], max_length: int, truncation: str) -> list[int]:
    """``ids`` cut to ``max_length`` the way upstream's ``truncation`` says (``error`` is the caller's)."""
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[-max_length:]
    if truncation == "right":
        return ids[:max_length]
    if truncation == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise ValueError(f"truncation={truncation!r} is not one of {list(TRUNCATIONS)}")


class DatasetError(ValueError):
    """A data file cannot be trained on; the message names the file, the row and the key that fixes it."""


@dataclass(frozen=True)
class _Columns:
    """The ``data`` config values each row needs, read once."""

    prompt_key: str
    reward_fn_key: str
    max_length: int
    truncation: str
    drop_long: bool


class RLHFDataset:
    """The tokenized prompts of ``files``: each row ``{"input_ids", "data_source", "ground_truth",
    "extra_info", "index", "raw_prompt"}``.

    Upstream's constructor signature: ``data_files`` (one path or a list), ``config`` the ``data`` config node
    (``prompt_key``, ``reward_fn_key``, ``max_prompt_length``, ``filter_overlong_prompts``, ``truncation``,
    ``apply_chat_template_kwargs``), ``processor`` (multimodal; refused here), ``max_samples``; ``key`` names
    the config key in error messages, ``template_source`` where the chat template came from. ``filtered`` and ``truncated`` count what the length rules did, for the
    start-up report.
    """

    def __init__(
        self,
        data_files: str | Sequence[str],
        tokenizer: Any,
        config: Mapping[str, Any],
        processor: Any = None,
        max_samples: int = -1,
        *,
        key: str = "data.train_files",
        template_source: str = "the tokenizer's chat_template",
    ) -> None:
        if processor is not None:
            raise NotImplementedError(f"{key}: multimodal prompts (a processor) are not supported here; pass processor=None")
        self.files = [data_files] if isinstance(data_files, str) else list(data_files)
        data = config
        prompt_key, max_length = str(data["prompt_key"]), int(data["max_prompt_length"])
        columns = _Columns(prompt_key, str(data["reward_fn_key"]), max_length, str(data["truncation"]), bool(data["filter_overlong_prompts"]))
        template_kwargs = dict(data.get("apply_chat_template_kwargs") or {})
        self.rows: list[dict] = []
        self.filtered = 0
        self.truncated = 0
        max_chars = max_prompt_chars(tokenizer, max_length)
        oversized = oversized_prompt_problems(self.files, prompt_key, max_chars, key, max_samples)
        if oversized:
            raise DatasetError(oversized[0])
        raws = read_parquet_rows(self.files, max_samples)
        for index, raw in enumerate(raws):
            try:
                check_messages(raw.get(prompt_key))
            except ValueError as exc:
                raise DatasetError(f"{key} row {index}: column {prompt_key!r}: {exc}") from None
        prompts = [raw[prompt_key] for raw in raws]
        if getattr(tokenizer, "chat_template", None):
            rendered = render_prompts(tokenizer, prompts, template_kwargs, max_chars, template_source, key)
        else:
            rendered = _joined(prompts, max_chars)
        with closing(rendered):
            try:
                for index, (raw, prompt) in enumerate(zip(raws, rendered, strict=True)):
                    self._add(index, raw, prompt, tokenizer, columns, key)
            except TemplateError as exc:
                raise DatasetError(str(exc)) from None
        if not self.rows:
            raise DatasetError(
                f"{key}: no prompt left of {self.files} (filter_overlong_prompts dropped {self.filtered} over "
                f"data.max_prompt_length={max_length})"
            )

    def _add(self, index: int, raw: Mapping[str, Any], prompt: Rendered, tokenizer: Any, columns: _Columns, key: str) -> None:
        """Tokenize one rendered prompt under the length rules and keep it (or count it dropped)."""
        max_length, truncation = columns.max_length, columns.truncation
        where = f"{key} row {index}"
        ids = _encode(tokenizer, prompt.text) if prompt.text is not None else None
        if ids is None or len(ids) > max_length:
            if columns.drop_long:
                self.filtered += 1
                return
            if truncation == "error":
                size = f"{len(ids)} tokens" if ids is not None else f"{prompt.length} characters, more than {max_length} tokens of this tokenizer can spell"
                raise DatasetError(
                    f"{where}: the prompt is {size}, over data.max_prompt_length={max_length}; raise it, "
                    "set data.filter_overlong_prompts=True, or data.truncation=left|right|middle"
                )
            ids = truncate(ids, max_length, truncation) if ids is not None else _ends(tokenizer, prompt, max_length, truncation)
            self.truncated += 1
        reward = raw.get("reward_model") or {}
        if not isinstance(reward, Mapping) or reward.get("ground_truth") is None:
            raise DatasetError(f"{where}: reward_model.ground_truth is missing (got reward_model={shown(reward)})")
        self.rows.append(
            {
                "input_ids": ids,
                "data_source": str(raw.get(columns.reward_fn_key)),
                "ground_truth": str(reward["ground_truth"]),
                "extra_info": raw.get("extra_info") or {},
                "index": index,
                "raw_prompt": raw.get(columns.prompt_key),
            }
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int) -> dict:
        return self.rows[item]

    @property
    def longest_prompt(self) -> int:
        return max(len(row["input_ids"]) for row in self.rows)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _ends(tokenizer: Any, prompt: Rendered, max_length: int, truncation: str) -> list[int]:
    """``truncate`` of a prompt too long to tokenize whole: the kept end(s) tokenized from the first / last
    characters the renderer kept, each more than ``max_length`` tokens can spell."""
    head = max_length if truncation == "right" else max_length // 2 if truncation == "middle" else 0
    if truncation not in ("left", "right", "middle"):
        raise ValueError(f"truncation={truncation!r} is not one of {list(TRUNCATIONS)}")
    start = _encode(tokenizer, prompt.head)[:head] if head else []
    end = _encode(tokenizer, prompt.tail)[head - max_length :] if max_length > head else []
    return start + end


def padded_prompt_length(longest: int, response_length: int, tp: int) -> int:
    """The one prompt length of a run: its longest prompt, plus the fewest pad tokens that make prompt +
    response a multiple of TP (sequence parallelism splits the sequence across TP ranks)."""
    return longest + (-(longest + response_length)) % max(tp, 1)


def left_pad(rows: Sequence[Mapping[str, Any]], length: int, pad_token_id: int):
    """``[rows, length]`` LongTensor of the rows' ``input_ids``, left-padded with ``pad_token_id``.

    Every prompt of a run has the same length, so a prompt's input never depends on the batch it is drawn in.
    """
    import torch

    out = torch.full((len(rows), length), int(pad_token_id), dtype=torch.long)
    for i, row in enumerate(rows):
        ids = row["input_ids"]
        if len(ids) > length:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the run's prompt length {length}")
        if ids:
            out[i, length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
    return out


def left_pad_attention_mask(rows: Sequence[Mapping[str, Any]], length: int):
    """``[rows, length]`` LongTensor matching ``left_pad``: 1 on each row's tokens, 0 on its padding (transformers'
    attention mask). Built from the prompt lengths, so a real token equal to the pad id is never masked."""
    import torch

    lengths = torch.tensor([len(row["input_ids"]) for row in rows], dtype=torch.long)
    return (torch.arange(length).unsqueeze(0) >= (length - lengths).unsqueeze(1)).long()
