"""Upstream's data format and rewards: parquet prompts, length rules, gsm8k's rule, the embedded task as parquet."""

from __future__ import annotations

import pytest

from verl.models.tiny import build_tokenizer
from verl.utils.dataset.rl_dataset import (
    DatasetError,
    RLHFDataset,
    left_pad,
    left_pad_attention_mask,
    max_prompt_chars,
    padded_prompt_length,
    parquet_problems,
    read_parquet_rows,
    truncate,
    write_rlhf_parquet,
)
from verl.utils.reward_score import default_compute_score, gsm8k

DATA = {
    "prompt_key": "prompt", "reward_fn_key": "data_source", "max_prompt_length": 12, "filter_overlong_prompts": False,
    "truncation": "error", "apply_chat_template_kwargs": {},
}  # fmt: skip


def _row(text: str, truth: str = "1", source: str = "openai/gsm8k") -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": text}], "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"k": 1}}


def test_gsm8k_rule_is_upstreams():
    assert gsm8k.compute_score("so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert gsm8k.compute_score("#### 1,234", "1234") == 1.0  # commas dropped
    assert gsm8k.compute_score("#### 8", "7") == 0.0 and gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("the answer is 7", "7") == 0.0  # strict: no '#### ' marker, no answer
    assert gsm8k.compute_score("the answer is 7", "7", method="flexible") == 1.0
    assert gsm8k.compute_score("#### 5 then #### 7", "7") == 1.0  # the last marker counts
    assert gsm8k.compute_score("#### 7" + " pad" * 100, "7") == 0.0  # only the last 300 characters are searched
    assert gsm8k.compute_score("#### 7.0", "7") == 0.0  # text equality, as upstream
    assert default_compute_score("openai/gsm8k", "#### 7", "7", extra_info={"x": 1}, sandbox_fusion_url=None) == 1.0
    with pytest.raises(NotImplementedError, match="known data sources"):
        default_compute_score("lighteval/MATH", "x", "1")


def test_parquet_rows_tokenize_truncate_and_filter(tmp_path):
    tok = build_tokenizer()
    path = write_rlhf_parquet([_row("2+2="), _row("a much longer prompt", "9")], str(tmp_path / "t.parquet"))
    assert read_parquet_rows([path], max_samples=1)[0]["reward_model"]["ground_truth"] == "1"
    with pytest.raises(DatasetError, match=r"row 1: the prompt is 20 tokens, over data.max_prompt_length=12"):
        RLHFDataset([path], tok, DATA)
    left = RLHFDataset([path], tok, {**DATA, "truncation": "left"})
    assert left.truncated == 1 and tok.decode(left[1]["input_ids"]).replace(" ", "") == "ongerprompt"  # its last 12 characters
    kept = RLHFDataset([path], tok, {**DATA, "filter_overlong_prompts": True})
    assert len(kept) == 1 and kept.filtered == 1 and kept[0]["ground_truth"] == "1" and kept[0]["extra_info"] == {"k": 1}
    assert truncate(list(range(10)), 4, "middle") == [0, 1, 8, 9] and truncate(list(range(10)), 4, "right") == [0, 1, 2, 3]


def test_upstream_constructor_keywords(tmp_path):
    tok = build_tokenizer()
    path = write_rlhf_parquet([_row("2+2=")], str(tmp_path / "t.parquet"))
    one = RLHFDataset(data_files=path, tokenizer=tok, config=DATA, processor=None, max_samples=-1)  # a single path
    assert one.files == [path] and len(one) == 1
    with pytest.raises(NotImplementedError, match="processor"):
        RLHFDataset(path, tok, DATA, processor=object())


def test_schema_problems_name_file_and_column(tmp_path):
    path = write_rlhf_parquet([{"question": "x", "data_source": "d"}], str(tmp_path / "bad.parquet"))
    (problem,) = parquet_problems([path, str(tmp_path / "none.parquet")][:1], "data.train_files", "prompt", "data_source")
    assert "bad.parquet has no column ['prompt', 'reward_model']" in problem
    assert "does not exist" in parquet_problems([str(tmp_path / "none.parquet")], "data.val_files", "prompt", "data_source")[0]


def test_prompts_pad_to_one_length_divisible_with_the_response():
    assert padded_prompt_length(7, 3, tp=2) == 7 and padded_prompt_length(6, 3, tp=2) == 7 and padded_prompt_length(5, 3, tp=4) == 5
    out = left_pad([{"input_ids": [5, 6]}, {"input_ids": [7, 8, 9]}], 4, pad_token_id=0)
    assert out.tolist() == [[0, 0, 5, 6], [0, 7, 8, 9]]
    # The attention mask follows the prompt lengths, not the pad id: a real token 0 stays attended to.
    assert left_pad_attention_mask([{"input_ids": [0, 6]}, {"input_ids": [7, 8, 9]}], 4).tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]


def test_embedded_task_as_parquet_reads_back_as_the_generated_task(tmp_path):
    from verl.utils.dataset.arithmetic import make_arithmetic_dataset, write_task_parquet

    path = write_task_parquet(str(tmp_path), seed=3, max_operand=2, task="first")
    tok = build_tokenizer()
    rows = RLHFDataset([path], tok, {**DATA, "reward_fn_key": "data_source"}).rows
    generated = make_arithmetic_dataset(3, max_operand=2, task="first")
    assert [r["input_ids"] for r in rows] == [tok(g["prompt"], add_special_tokens=False)["input_ids"] for g in generated]
    assert [(r["ground_truth"], r["data_source"]) for r in rows] == [(g["ground_truth"], "arithmetic") for g in generated]


class _Recording:
    """The tiny tokenizer, recording the length of every text it tokenizes (the test observes what is tokenized)."""

    def __init__(self, tokenizer, template: str | None = None):
        self.tokenizer, self.lengths = tokenizer, []
        self.tokenizer.chat_template = template

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)


def test_a_prompt_longer_than_the_length_rule_can_use_is_never_tokenized_whole(tmp_path):
    """Its characters decide: refused, dropped, or cut to its kept end(s) with the tokens a whole tokenization
    keeps (a character-level tokenizer: every cut is exact); only what the rule can keep is tokenized."""
    text = "".join(chr(ord("a") + i % 26) for i in range(200_000))
    path = write_rlhf_parquet([_row("2+2="), _row(text)], str(tmp_path / "t.parquet"))
    whole = build_tokenizer()(text, add_special_tokens=False)["input_ids"]
    tok = _Recording(build_tokenizer())
    with pytest.raises(DatasetError, match=r"row 1: the prompt is 200000 characters, more than 12 tokens of this tokenizer can spell"):
        RLHFDataset([path], tok, DATA)
    for truncation in ("left", "right", "middle"):
        cut = RLHFDataset([path], tok, {**DATA, "truncation": truncation})
        assert cut.truncated == 1 and cut[1]["input_ids"] == truncate(whole, 12, truncation), truncation
    assert RLHFDataset([path], tok, {**DATA, "filter_overlong_prompts": True}).filtered == 1
    assert max(tok.lengths) <= max_prompt_chars(tok, 12) < len(text)


def test_a_hostile_chat_template_fails_in_one_line_naming_its_source(tmp_path):
    path = write_rlhf_parquet([_row("2+2=")], str(tmp_path / "t.parquet"))
    for template, raised in (
        ("{{ raise_exception('no tools here') }}", r"\(TemplateError: no tools here\); fix the template or the row"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", r"\(SecurityError: access to attribute '__class__' of 'str' object is unsafe\.\); fix the template"),
        ("{{ 'x' * 100000 * 100000 }}", r"\(it needed more than 1024 MiB of memory\); fix the template"),
    ):
        with pytest.raises(DatasetError, match=rf"^the template key: the chat template failed on data.train_files row 0 {raised}$"):
            RLHFDataset([path], _Recording(build_tokenizer(), template), DATA, template_source="the template key")
    good = RLHFDataset([path], _Recording(build_tokenizer(), "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"), DATA)
    assert build_tokenizer().decode(good[0]["input_ids"]).replace(" ", "") == "[2+2=]"


class _CountingConfig(dict):
    """A ``data`` config node that counts how often each key is read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: dict[str, int] = {}

    def __getitem__(self, key):
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().__getitem__(key)


def test_the_config_is_read_once_not_per_row(tmp_path):
    path = write_rlhf_parquet([_row("2+2=")] * 20, str(tmp_path / "t.parquet"))
    config = _CountingConfig(DATA)
    assert len(RLHFDataset([path], build_tokenizer(), config)) == 20
    assert config.reads and max(config.reads.values()) == 1, config.reads
