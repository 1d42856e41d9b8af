"""The one rule for every model, tokenizer, HF export or checkpoint folder this package reads: its code never runs.

transformers runs Python files that a folder's JSON names (``auto_map``; a ``model_type`` or ``tokenizer_class``
that only such files define) when asked to trust them, and without an answer it asks on the terminal
("Do you wish to run the custom code? [y/N]"). This package never needs such code: the bridge builds built-in
transformers families only (docs/models.md). So every config and tokenizer load of the package goes through
``load_config`` / ``load_tokenizer`` here, which

- first refuse, in one line naming the file and the key, a folder whose JSON names custom code (``auto_map``,
  a ``model_type`` transformers does not define, a ``tokenizer_class`` transformers' resolver does not find), and
- then call transformers with ``trust_remote_code=False`` explicitly, so it never asks and never runs a file.

No switch turns this off: upstream's ``actor_rollout_ref.model.trust_remote_code`` and the merger's
``--trust-remote-code`` are accepted for their command lines and change nothing, and a checkpoint being
verified, resumed or merged is checked the same way (``verl.utils.checkpoint.integrity.verify_checkpoint``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from verl.utils.one_line import one_line, shown

# The files of an HF folder whose keys make transformers import the folder's Python files.
NAMING_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
CODE_SUFFIXES = (".py", ".pyc", ".so")  # never copied into a folder this package writes
MAX_JSON_BYTES = 64 << 20  # a tokenizer_config.json with tens of thousands of added tokens is a few MB
MAX_VOCABULARY_BYTES = 512 << 20  # a real tokenizer.json is 10-30 MB
# Every top-level file transformers' config and tokenizer loaders read whole, with the most each may hold.
LOADED_FILES = {
    **dict.fromkeys(NAMING_FILES, MAX_JSON_BYTES),
    **dict.fromkeys(("special_tokens_map.json", "added_tokens.json", "generation_config.json", "chat_template.json"), MAX_JSON_BYTES),
    "chat_template.jinja": 16 << 20,
    **dict.fromkeys(("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model"), MAX_VOCABULARY_BYTES),
}
RULE = "this package never runs code from a model, tokenizer or checkpoint folder (docs/operations.md, 'What loading a checkpoint trusts')"


class CustomCodeError(ValueError):
    """A folder names code that transformers would import; the message is one line: the file, the key, the fix."""


def oversized_file_problem(path: str, max_bytes: int = MAX_JSON_BYTES) -> str | None:
    """A line when ``path`` exists but is no regular file (a link to one is) of at most ``max_bytes``: read
    whole, as transformers reads it, it could take any amount of memory or never end (a link to /dev/zero)."""
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):
        return f"{path} is not a regular file"
    size = os.path.getsize(path)
    return f"{path} is {size} bytes, more than any such HF file holds ({max_bytes >> 20} MiB)" if size > max_bytes else None


def read_json(path: str) -> Any:
    """The JSON value in ``path``. ValueError (one line) when it is not UTF-8 JSON, or nests deeper than
    Python's parser follows (``[[[...]]]``: a RecursionError, not a decode error)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except RecursionError:
        raise ValueError(f"{path} is unreadable JSON: it nests deeper than the parser follows") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise ValueError(f"{path} is unreadable JSON ({one_line(exc, 200)})") from None


def _read_object(path: str) -> tuple[dict, str | None]:
    """(The JSON object in ``path``, a line when it is no readable JSON). {} when the file is absent or is JSON but
    not an object (the loader that reads it says why: neither names code)."""
    try:
        value = read_json(path)
    except OSError:
        return {}, None
    except ValueError as exc:
        return {}, str(exc)
    return (value if isinstance(value, dict) else {}), None


def _is_transformers_tokenizer_class(name: Any) -> bool:
    """Whether transformers' own resolver finds a tokenizer class of that name (it maps retired names such as
    ``BloomTokenizerFast`` to their successors); an empty name is the same as none."""
    from transformers import PreTrainedTokenizerBase
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    if name == "":
        return True
    if not isinstance(name, str):
        return False
    found = tokenizer_class_from_name(name)
    return isinstance(found, type) and issubclass(found, PreTrainedTokenizerBase)


def _is_transformers_model_type(model_type: Any) -> bool:
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _transformers_version() -> str:
    import transformers

    return ".".join(transformers.__version__.split(".")[:2])


def custom_code_problems(folder: str) -> list[str]:
    """One line per file the loaders would read whole that is too large or no regular file, and per key of the
    folder's JSON files that names code transformers would have to import."""
    problems = []
    for name, max_bytes in LOADED_FILES.items():
        oversized = oversized_file_problem(os.path.join(folder, name), max_bytes)
        if oversized:
            problems.append(oversized)
    for name in NAMING_FILES:
        path = os.path.join(folder, name)
        if oversized_file_problem(path):
            continue
        content, unreadable = _read_object(path)
        if unreadable:
            problems.append(unreadable)
            continue
        if "auto_map" in content:
            problems.append(f"{path}: auto_map names custom code ({json.dumps(content['auto_map'])[:200]})")
        if name == "config.json" and "model_type" in content and not _is_transformers_model_type(content["model_type"]):
            problems.append(f"{path}: model_type={shown(content['model_type'], 80)} is unknown to transformers {_transformers_version()} (custom code or a newer transformers)")
        if content.get("tokenizer_class") is not None and not _is_transformers_tokenizer_class(content["tokenizer_class"]):
            problems.append(f"{path}: tokenizer_class={shown(content['tokenizer_class'], 80)} is not a tokenizer class of transformers {_transformers_version()} (custom code or a newer transformers)")
    return problems


def refuse_custom_code(folder: str, where: str, fix: str) -> None:
    """Raise CustomCodeError (``where``: the config key or argument that gave the folder) when it names code."""
    problems = custom_code_problems(folder)
    if problems:
        raise CustomCodeError(f"{where}: {'; '.join(problems)}; {RULE}: {fix}")


_FOLDER_FIX = "use a folder of a built-in transformers model and tokenizer (if it holds one, remove the keys named and the .py files)"


def load_config(folder: str, where: str, fix: str = _FOLDER_FIX) -> Any:
    """``AutoConfig.from_pretrained(folder)``, never running or asking to run the folder's code."""
    from transformers import AutoConfig

    refuse_custom_code(folder, where, fix)
    return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def load_tokenizer(folder: str, where: str, fix: str = _FOLDER_FIX) -> Any:
    """``AutoTokenizer.from_pretrained(folder)``, never running or asking to run the folder's code."""
    from transformers import AutoTokenizer

    refuse_custom_code(folder, where, fix)
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def is_code_file(name: str) -> bool:
    """Whether a file of an HF folder is code (left out of any folder this package writes)."""
    return name.endswith(CODE_SUFFIXES)
