"""Hostile inputs through the command line, one table: each refused in one line before any work, nothing of it runs.

Every case is one ``Case`` in ``CASES``: its kind (what the user hands over), a builder that makes the hostile
input in the case's directory and returns the command line (``python -m ...``), and the regex its last stderr
line must match. Each case runs its command with a pseudo-terminal as stdin and ``y`` typed ahead (a program
that asks "Do you wish to run the custom code? [y/N]" would get its yes), and asserts: a non-zero exit, the one
line, no file a payload (a ``.py`` beside a config, a crafted pickle) would create, no such question asked,
and the memory the command added (its rusage's peak over the interpreter's) under the case's ``grown_mb``. A new component's inputs are one entry more. The
commands run in forks of a server that has imported their third-party packages once (``tests/preloaded_commands.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.checkpoint_builders import craft_metadata, entry_outside_the_step, rewrite_manifest, train_and_save
from tests.main_leg import MBRIDGE, with_rollout
from tests.preloaded_commands import Outcome, PreloadedCommands
from verl.utils.dataset.rl_dataset import write_rlhf_parquet
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

TIMEOUT_S = 120
QUESTION = "Do you wish to run the custom code"
_M = "actor_rollout_ref.actor.megatron"
ONE_RANK = [
    "trainer.n_gpus_per_node=1", f"{_M}.tensor_model_parallel_size=1", f"{_M}.pipeline_model_parallel_size=1",
    f"{_M}.expert_model_parallel_size=1", f"{_M}.expert_tensor_parallel_size=1", "trainer.save_freq=-1",
    "trainer.logger=[console]", "trainer.resume_mode=disable",
]  # fmt: skip


@dataclass(frozen=True)
class Inputs:
    """What a builder starts from: the case's own directory, the marker a payload would create, the tiny model
    (read-only: copy it to change it) and the saved steps (``dist``: model as Megatron shards, no HF config;
    ``hf``: model as an HF folder; read-only too)."""

    work: Path
    marker: str
    model: str
    steps: dict[str, str]

    def model_copy(self) -> str:
        return shutil.copytree(self.model, self.work / "model")

    def step_copy(self, kind: str) -> str:
        """A copy of the ``kind`` step: returns its ``global_step_1/actor`` directory."""
        root = shutil.copytree(os.path.dirname(os.path.dirname(self.steps[kind])), self.work / "run")
        return os.path.join(root, "global_step_1", "actor")

    def trainer(self, *overrides: str, model: str | None = None) -> list[str]:
        given = [f"actor_rollout_ref.model.path={model or self.model}", *ONE_RANK, f"trainer.default_local_dir={self.work / 'out'}", *overrides]
        return ["-m", "verl.trainer.main_ppo", MBRIDGE, *with_rollout(given)]


@dataclass(frozen=True)
class Case:
    kind: str  # model folder | tokenizer | template | data file | checkpoint file
    name: str
    build: Callable[[Inputs], list[str]]  # makes the input under Inputs.work; returns the command after ``python``
    last_line: str  # regex (re.search) for the last line on stderr
    grown_mb: int = 3000  # the bound on the memory the command adds: its own imports cost ~0.1-0.3 GB


# --------------------------------------------------------------------------- builders


def _payload(folder: str, module: str, marker: str) -> None:
    """``<module>.py`` that creates ``marker`` when imported (the stand-in for any code)."""
    with open(os.path.join(folder, f"{module}.py"), "w") as handle:
        handle.write(f"open({marker!r}, 'w').write('ran')\n")


def _edit_json(path: str, **changes) -> None:
    content = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    content.update(changes)
    Path(path).write_text(json.dumps(content))


def _name_code(folder: str, file: str, marker: str, **changes) -> None:
    """``file`` of ``folder`` given ``changes`` that name ``evil_code.py``, written beside it."""
    _payload(folder, "evil_code", marker)
    _edit_json(os.path.join(folder, file), **changes)


_AUTO_MAP = {"AutoConfig": "evil_code.EvilConfig", "AutoModelForCausalLM": "evil_code.EvilModel"}
_TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["evil_code.EvilTokenizer", "evil_code.EvilTokenizer"]}


def _model_with(file: str, **changes) -> Callable[[Inputs], list[str]]:
    def build(inputs: Inputs) -> list[str]:
        model = inputs.model_copy()
        _name_code(model, file, inputs.marker, **changes)
        return inputs.trainer(model=model)

    return build


def _model_config_text(text: str) -> Callable[[Inputs], list[str]]:
    def build(inputs: Inputs) -> list[str]:
        model = inputs.model_copy()
        Path(model, "config.json").write_text(text)
        return inputs.trainer(model=model)

    return build


def _model_json_sparse(file: str) -> Callable[[Inputs], list[str]]:
    """``file`` grown to 10 GB of holes: nothing on disk, everything to a reader that reads it whole."""

    def build(inputs: Inputs) -> list[str]:
        model = inputs.model_copy()
        os.truncate(os.path.join(model, file), 10 << 30)
        return inputs.trainer(model=model)

    return build


def _model_file_linked_to_dev_zero(file: str) -> Callable[[Inputs], list[str]]:
    """``file`` of the model replaced by a symlink to /dev/zero: endless to a reader that reads it whole."""

    def build(inputs: Inputs) -> list[str]:
        model = inputs.model_copy()
        path = os.path.join(model, file)
        if os.path.exists(path):
            os.remove(path)
        os.symlink("/dev/zero", path)
        return inputs.trainer(model=model)

    return build


def _merge_with_model(change: Callable[[str, str], None]) -> Callable[[Inputs], list[str]]:
    """``merge --hf_model_path`` of a copy of the model, ``change(model, marker)`` made to it."""

    def build(inputs: Inputs) -> list[str]:
        model = inputs.model_copy()
        change(model, inputs.marker)
        step = inputs.step_copy("dist")
        return ["-m", "verl.model_merger", "merge", "--backend", "megatron", "--local_dir", step, "--target_dir", str(inputs.work / "merged"), "--hf_model_path", model, "--trust-remote-code"]

    return build


def _deeply_nested_config(model: str, marker: str) -> None:
    Path(model, "config.json").write_text("[" * 200_000 + "]" * 200_000)  # 400 KB


def _template(template: str) -> Callable[[Inputs], list[str]]:
    def build(inputs: Inputs) -> list[str]:
        return inputs.trainer(f"actor_rollout_ref.model.custom_chat_template='{template}'")

    return build


def _tokenizer_template(file: str) -> Callable[[Inputs], list[str]]:
    """The model folder's own template (``tokenizer_config.json``'s chat_template or ``chat_template.jinja``) raises."""

    def build(inputs: Inputs) -> list[str]:
        model = inputs.model_copy()
        template = "{{ raise_exception('a template from the model folder') }}"
        if file.endswith(".json"):
            _edit_json(os.path.join(model, file), chat_template=template)
        else:
            Path(model, file).write_text(template)
        return inputs.trainer(model=model)

    return build


def _row(prompt, truth="1") -> dict:
    return {"data_source": "openai/gsm8k", "prompt": prompt, "reward_model": {"style": "rule", "ground_truth": truth}}


_ONE_PROMPT = ("data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")


def _data(rows: list[dict], *overrides: str) -> Callable[[Inputs], list[str]]:
    def build(inputs: Inputs) -> list[str]:
        path = write_rlhf_parquet(rows, str(inputs.work / "train.parquet"))
        return inputs.trainer(f"data.train_files={path}", *_ONE_PROMPT, *overrides)

    return build


def _data_text(inputs: Inputs) -> list[str]:
    path = inputs.work / "train.parquet"
    path.write_text("prompt,answer\n2+2=,4\n")
    return inputs.trainer(f"data.train_files={path}", *_ONE_PROMPT)


_HUGE = [{"role": "user", "content": "a" * 20_000_000}]  # ~0.9 MB as parquet


# Writes argv[2] times "a" as one row's prompt, zstd-compressed, to argv[1]: ~10 KB on disk for 300 M characters.
# Built as Arrow arrays, never a Python string, and in a process of its own, so the test process stays small.
_COMPRESSED_PROMPT_WRITER = """
import sys
import pyarrow as pa, pyarrow.compute as pc, pyarrow.parquet as pq
content = pc.binary_repeat(pa.array(["a"], pa.string()), int(sys.argv[2]))
message = pa.StructArray.from_arrays([pa.array(["user"]), content], names=["role", "content"])
truth = pa.StructArray.from_arrays([pa.array(["rule"]), pa.array(["1"])], names=["style", "ground_truth"])
prompt = pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), message)
table = pa.table({"data_source": ["openai/gsm8k"], "prompt": prompt, "reward_model": truth})
pq.write_table(table, sys.argv[1], compression="zstd", use_dictionary=False, write_statistics=False)
"""


def _data_of_one_prompt_compressed(characters: int) -> Callable[[Inputs], list[str]]:
    def build(inputs: Inputs) -> list[str]:
        import subprocess

        path = inputs.work / "train.parquet"
        subprocess.run([sys.executable, "-c", _COMPRESSED_PROMPT_WRITER, str(path), str(characters)], check=True)
        return inputs.trainer(f"data.train_files={path}", *_ONE_PROMPT)

    return build


def _step_hf_naming_code(kind: str, file: str, **changes) -> Callable[[Inputs], str]:
    """A step whose ``model/huggingface/<file>`` names ``evil_code.py`` beside it, the manifest re-hashed (the
    sweep's case: anyone who hands over a checkpoint can)."""

    def make(inputs: Inputs) -> str:
        step = inputs.step_copy(kind)
        hf = os.path.join(step, "model", "huggingface")
        if not os.path.exists(os.path.join(hf, "config.json")):
            shutil.copy(os.path.join(inputs.model, "config.json"), hf)
        _name_code(hf, file, inputs.marker, **changes)
        rewrite_manifest(step)
        return step

    return make


def _crafted_metadata(inputs: Inputs) -> str:
    step = inputs.step_copy("dist")
    craft_metadata(step, inputs.marker)
    return step


def _entry_outside(inputs: Inputs) -> str:
    step = inputs.step_copy("dist")
    entry_outside_the_step(step)
    return step


def _verify(make: Callable[[Inputs], str]) -> Callable[[Inputs], list[str]]:
    return lambda inputs: ["-m", "verl.model_merger", "verify", "--local_dir", make(inputs)]


def _merge(make: Callable[[Inputs], str]) -> Callable[[Inputs], list[str]]:
    return lambda inputs: ["-m", "verl.model_merger", "merge", "--backend", "megatron", "--local_dir", make(inputs), "--target_dir", str(inputs.work / "merged"), "--trust-remote-code"]


def _resume(make: Callable[[Inputs], str]) -> Callable[[Inputs], list[str]]:
    def build(inputs: Inputs) -> list[str]:
        step = make(inputs)
        return inputs.trainer("trainer.resume_mode=resume_path", f"trainer.resume_from_path={os.path.dirname(step)}")

    return build


# The sweep's step: the dist step given its own config.json of an unknown model_type whose auto_map names a .py.
_SWEEP_STEP = _step_hf_naming_code("dist", "config.json", model_type="evil_net", auto_map=_AUTO_MAP)
_CODE = r"(auto_map names custom code|unknown to transformers|not a tokenizer class of transformers).*never runs code from a model, tokenizer or checkpoint folder"
_TEMPLATE_FAILED = r"^  - actor_rollout_ref\.model\.custom_chat_template: the chat template failed on data\.train_files row 0 \({}\); fix the template$"
_TEMPLATE_REJECTED = _TEMPLATE_FAILED.replace("template$", "template or the row$")

CASES = [
    Case("model folder", "auto_map_with_a_builtin_model_type", _model_with("config.json", auto_map=_AUTO_MAP), rf"^  - actor_rollout_ref\.model\.path=.*config\.json: {_CODE}"),
    Case("model folder", "unknown_model_type_and_auto_map", _model_with("config.json", model_type="evil_net", auto_map=_AUTO_MAP), r"^  - actor_rollout_ref\.model\.path=.*: model_type='evil_net' is not supported"),
    Case("model folder", "auto_map_in_preprocessor_config", _model_with("preprocessor_config.json", auto_map={"AutoProcessor": "evil_code.EvilProcessor"}), rf"preprocessor_config\.json: {_CODE}"),
    Case("model folder", "config_json_not_json", _model_config_text("{not json"), r"^  - actor_rollout_ref\.model\.path=.*config\.json is unreadable JSON \(Expecting"),
    Case("model folder", "config_json_of_10_GB", _model_json_sparse("config.json"), r"^  - actor_rollout_ref\.model\.path=.*config\.json is 10737418240 bytes, more than any such HF file holds"),
    Case("model folder", "merge_hf_model_path_deeply_nested_config_json", _merge_with_model(_deeply_nested_config), r"^merge failed: --hf_model_path .*config\.json is unreadable JSON: it nests deeper than the parser follows"),
    Case("model folder", "merge_hf_model_path_naming_code", _merge_with_model(lambda model, marker: _name_code(model, "config.json", marker, auto_map=_AUTO_MAP)), rf"^merge failed: --hf_model_path .*config\.json: {_CODE}.*--trust-remote-code does not change this"),
    Case("tokenizer", "auto_map_in_tokenizer_config", _model_with("tokenizer_config.json", auto_map=_TOKENIZER_AUTO_MAP), rf"^  - actor_rollout_ref\.model\.path=.*tokenizer_config\.json: {_CODE}"),
    Case("tokenizer", "tokenizer_config_json_of_10_GB", _model_json_sparse("tokenizer_config.json"), r"^  - actor_rollout_ref\.model\.path=.*tokenizer_config\.json is 10737418240 bytes"),
    Case("tokenizer", "tokenizer_json_of_10_GB", _model_json_sparse("tokenizer.json"), r"^  - actor_rollout_ref\.model\.path=.*tokenizer\.json is 10737418240 bytes, more than any such HF file holds \(512 MiB\)"),
    Case("tokenizer", "chat_template_jinja_linked_to_dev_zero", _model_file_linked_to_dev_zero("chat_template.jinja"), r"^  - actor_rollout_ref\.model\.path=.*chat_template\.jinja is not a regular file"),
    Case("tokenizer", "custom_tokenizer_class", _model_with("tokenizer_config.json", tokenizer_class="EvilTokenizer"), r"tokenizer_config\.json: tokenizer_class='EvilTokenizer' is not a tokenizer class of transformers \d+\.\d+ .*never runs code from"),
    Case("template", "raise_exception", _template("{{ raise_exception(\"stop\") }}"), _TEMPLATE_REJECTED.format(r"TemplateError: stop")),
    Case("template", "sandbox_escape", _template("{{ cycler.__init__.__globals__.os.system(\"touch MARKER\") }}"), _TEMPLATE_FAILED.format(r"SecurityError: .*unsafe.*")),
    Case("template", "loop_of_10_to_the_10", _template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"), r"custom_chat_template: the chat template ran more than 5 s on data\.train_files row 0 and was stopped"),
    Case("template", "memory_bomb", _template("{{ \"x\" * 100000 * 100000 }}"), _TEMPLATE_FAILED.format(r"it needed more than 1024 MiB of memory")),
    Case("template", "syntax_error", _template("{% for %}"), _TEMPLATE_FAILED.format(r"TemplateSyntaxError: .*")),
    Case("template", "in_tokenizer_config", _tokenizer_template("tokenizer_config.json"), r"the chat template of .*/model/tokenizer_config\.json: the chat template failed on data\.train_files row 0 \(TemplateError: a template from the model folder\); fix the template or the row$"),
    Case("template", "in_chat_template_jinja", _tokenizer_template("chat_template.jinja"), r"the chat template of .*/model/chat_template\.jinja: the chat template failed"),
    Case("data file", "prompt_of_20M_characters", _data([_row(_HUGE)]), r"^  - data\.train_files row 0: the prompt is 20000000 characters, more than 8 tokens of this tokenizer can spell, over data\.max_prompt_length=8"),
    Case("data file", "prompt_of_300M_characters_in_10_KB_of_zstd", _data_of_one_prompt_compressed(300_000_000), r"^  - data\.train_files: .*train\.parquet rows 0\.\.0 hold 3000000\d\d bytes of prompt text uncompressed, .*is not read; remove or shorten it$", grown_mb=200),  # ~40 MB; reading the 300 MB would pass 200
    Case("data file", "prompt_not_messages", _data([_row("2+2=")]), r"^  - data\.train_files row 0: column 'prompt': a prompt must be a list of chat messages"),
    Case("data file", "no_ground_truth", _data([{**_row([{"role": "user", "content": "2+2="}]), "reward_model": {"style": "rule"}}]), r"^  - data\.train_files row 0: reward_model\.ground_truth is missing"),
    Case("data file", "not_parquet", _data_text, r"^  - data\.train_files: .*train\.parquet is not a readable parquet file"),
    Case("checkpoint file", "verify_hf_config_naming_code", _verify(_SWEEP_STEP), rf"^DAMAGED: checkpoint .*model/huggingface/config\.json: {_CODE}"),
    Case("checkpoint file", "merge_hf_config_naming_code", _merge(_SWEEP_STEP), rf"^merge failed: checkpoint .*model/huggingface/config\.json: {_CODE}"),
    Case("checkpoint file", "resume_hf_config_naming_code", _resume(_SWEEP_STEP), rf"^  - trainer\.resume_mode=resume_path: checkpoint .*config\.json: {_CODE}"),
    Case("checkpoint file", "merge_hf_export_tokenizer_naming_code", _merge(_step_hf_naming_code("hf", "tokenizer_config.json", auto_map=_TOKENIZER_AUTO_MAP)), rf"^merge failed: checkpoint .*tokenizer_config\.json: {_CODE}"),
    Case("checkpoint file", "verify_crafted_metadata", _verify(_crafted_metadata), r"^DAMAGED: .*optimizer/dist_ckpt/\.metadata names io\.open"),
    Case("checkpoint file", "resume_crafted_metadata", _resume(_crafted_metadata), r"^  - trainer\.resume_mode=resume_path: .*\.metadata names io\.open"),
    Case("checkpoint file", "verify_manifest_entry_outside_the_step", _verify(_entry_outside), r"^DAMAGED: .*entry '\.\./\.\./outside\.txt' lies outside the step"),
]  # fmt: skip


# --------------------------------------------------------------------------- running a case


def run_with_yes_typed(commands: PreloadedCommands, argv: list[str], cwd: Path, env: dict) -> Outcome:
    """``python <argv>`` with a pseudo-terminal as stdin, ``y`` typed ahead; stdout / stderr captured apart; its
    exit code and the memory it added. Past ``TIMEOUT_S`` the command is killed: exit code -9."""
    controller, terminal = os.openpty()
    os.write(controller, b"y\n")
    try:
        return commands.run(argv, cwd, env, os.ttyname(terminal), TIMEOUT_S)
    finally:
        os.close(terminal)
        os.close(controller)


@pytest.fixture(scope="module")
def steps(tiny_dense_path, tmp_path_factory) -> dict[str, str]:
    """One step of each model format, trained and saved once for the module (1 rank, the tiny dense model)."""
    root = str(tmp_path_factory.mktemp("hostile_steps"))
    run_on_ranks(train_and_save, 1, ParallelSizes(), args=(tiny_dense_path, root))
    return {kind: os.path.join(root, f"dc_{dist}", "global_step_1", "actor") for kind, dist in (("dist", True), ("hf", False))}


def test_the_table_covers_every_kind():
    kinds = {case.kind for case in CASES}
    assert kinds == {"model folder", "tokenizer", "template", "data file", "checkpoint file"} and len(CASES) >= 25
    assert len({case.name for case in CASES}) == len(CASES)


def test_every_config_and_tokenizer_load_goes_through_the_one_check():
    """No module but ``verl/utils/custom_code.py`` calls transformers' ``from_pretrained``, and a function that
    calls Megatron-Bridge's ``AutoBridge.from_hf_pretrained`` runs the same check first: every folder the
    package loads passes it, with ``trust_remote_code=False`` said explicitly at every such call."""
    import ast

    package = Path(__file__).resolve().parent.parent / "verl"
    calls, unchecked = [], []
    for path in sorted(package.rglob("*.py")):
        where = str(path.relative_to(package.parent))
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            called = [n for n in ast.walk(function) if isinstance(n, ast.Call)]
            names = {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", None) for c in called}
            for node in called:
                if isinstance(node.func, ast.Attribute) and node.func.attr in ("from_pretrained", "from_hf_pretrained"):
                    calls.append((where, node))
                    if node.func.attr == "from_hf_pretrained" and "refuse_custom_code" not in names:
                        unchecked.append(f"{where}:{node.lineno}")
    elsewhere = sorted({where for where, node in calls if node.func.attr == "from_pretrained" and where != "verl/utils/custom_code.py"})
    assert not elsewhere, f"from_pretrained outside verl/utils/custom_code.py: {elsewhere}"
    assert not unchecked, f"from_hf_pretrained without refuse_custom_code first: {unchecked}"
    explicit = [any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False for k in node.keywords) for _, node in calls]
    assert {node.func.attr for _, node in calls} == {"from_pretrained", "from_hf_pretrained"} and all(explicit)


def test_a_tokenizer_class_is_judged_by_transformers_own_resolver(tmp_path):
    """Retired names transformers still maps (``BloomTokenizerFast``) and an empty name pass; a class that is no
    tokenizer (``AutoModel``) or unknown does not, echoed on one bounded line."""
    from verl.utils.custom_code import custom_code_problems

    def problems(tokenizer_class) -> list[str]:
        Path(tmp_path, "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}))
        return custom_code_problems(str(tmp_path))

    assert problems("BloomTokenizerFast") == [] and problems("") == [] and problems("Qwen2Tokenizer") == []
    assert all(len(problems(name)) == 1 for name in ("AutoModel", "EvilTokenizer", 7))
    (line,) = problems("Evil\n" * 10_000)
    assert "\n" not in line and len(line) < 400


def _case_id(case: Case) -> str:
    return f"{case.kind.replace(' ', '_')}-{case.name}"


@dataclass
class Ran:
    """One case's command as it ran: its outcome, its directory and the marker its payload would create."""

    outcome: Outcome
    work: Path
    marker: str


@pytest.fixture(scope="module")
def ran(request, tiny_dense_path, steps, tmp_path_factory) -> dict[str, Ran]:
    """Every selected case built, then run two at a time, each through one of two servers that have imported what
    every command imports first (what each command adds to its memory is still its own): the matrix's cost is the commands'
    own work, each case still asserted by its own test."""
    from concurrent.futures import ThreadPoolExecutor

    selected = [item.callspec.params["case"] for item in request.session.items if getattr(item, "originalname", "") == "test_a_hostile_input_is_refused_in_one_line_and_nothing_of_it_runs"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    built = {}
    for case in selected:
        work = tmp_path_factory.mktemp(case.name) / "case"
        work.mkdir()
        marker = str(work / "MARKER")
        env = {**os.environ, "PYTHONPATH": pythonpath, "VERL_TINY_MODEL_CACHE": str(work.parent / "cache")}
        built[_case_id(case)] = (case.build(Inputs(work, marker, tiny_dense_path, steps)), work, marker, env)
    names = list(built)
    halves = [names[0::2], names[1::2]]
    server_env = {**os.environ, "PYTHONPATH": pythonpath}

    def run_half(half: list[str]) -> dict[str, Outcome]:
        outcomes = {}
        with PreloadedCommands(server_env) as commands:
            for name in half:
                argv, work, _, env = built[name]
                outcomes[name] = run_with_yes_typed(commands, argv, work, env)
        return outcomes

    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = {name: outcome for done in pool.map(run_half, halves) for name, outcome in done.items()}
    return {name: Ran(outcomes[name], work, marker) for name, (_, work, marker, _) in built.items()}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_hostile_input_is_refused_in_one_line_and_nothing_of_it_runs(case, ran):
    this = ran[_case_id(case)]
    outcome, work, marker = this.outcome, this.work, this.marker
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    shown = f"rc={outcome.returncode}\n--- stdout\n{outcome.stdout[-2000:]}\n--- stderr\n{outcome.stderr[-4000:]}"
    assert outcome.returncode not in (0, -9), shown  # refused, not killed by the timeout
    assert lines and re.search(case.last_line, lines[-1]), shown
    assert "Traceback" not in outcome.stderr and QUESTION not in outcome.stdout + outcome.stderr, shown
    assert not os.path.exists(marker), f"the payload ran\n{shown}"
    assert not os.path.exists(work / "merged") and not os.path.exists(str(work / "merged") + ".merging")
    assert outcome.grown_mb < case.grown_mb, f"grew {outcome.grown_mb:.0f} MB\n{shown}"
