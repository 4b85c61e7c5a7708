"""Fuzz: every bad value of every config key is one config error naming the key, never a traceback.

The bad values are generated from the key table (orchestrator.loader.config.key_table),
so a new key is fuzzed as soon as it is declared. Every case is validated in
process through `load`, the function the CLI calls (or, where the check needs the
devices, through the job `train` builds before it allocates anything); a few go
through the real console script to show exit code 2 and no traceback. Issue 58 added seeded cases of
damaged Hugging Face directories (25), broken arrays, data factories and raising user code (35): each exits 2,
none with a traceback of nestor's.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from nestor.orchestrator.commands import cli
from nestor.orchestrator.loader import memory_fit
from nestor.orchestrator.loader.config import INT32_MAX, Key, key_table, load
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.loader.idle_keys import idle_keys, idle_warning
from nestor.orchestrator.job.build import build_job, select_devices
from tests.settings import ROOT
from tests.helpers import child_env, ended

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def _wrong_type(hint) -> str:
    text = str(hint)
    if "bool" in text:
        return "5"
    if "int" in text or "float" in text:
        return "fast"
    return "{a: 1}" if "tuple" in text or text == "<class 'str'>" or "str |" in text else "5"


def bad_values(hint, spec: Key) -> list[str]:
    """Returns YAML texts a key of type `hint` and limits `spec` must refuse."""
    values = [_wrong_type(hint)]
    text = str(hint)
    if "float" in text:
        values += [".nan", ".inf", "-.inf"]
    if "int" in text and "float" not in text:
        values += [str(2**70), str(INT32_MAX + 1 if spec.maximum is None else spec.maximum + 1)]
    if spec.minimum is not None:
        below = spec.minimum - 1
        values.append(str(below - 1 if below in spec.also else below))
    if spec.above is not None:
        values.append(str(spec.above))
    if spec.below is not None:
        values.append(str(spec.below))
    if spec.maximum is not None and "float" in text:
        values.append(str(spec.maximum + 0.5))
    if spec.choices:
        values.append("[not-a-choice]" if "tuple" in text else "not-a-choice")
    return values


def generated_cases() -> list[tuple[str, str]]:
    """Returns (override, the key its error must name) for every bad value of every key and section."""
    cases = [(f"{path}={value}", path) for path, hint, _, spec in key_table() for value in bad_values(hint, spec)]
    sections = sorted({path.split(".")[0] for path, *_ in key_table()})
    cases += [(f"{section}=5", section) for section in sections]
    cases += [(f"{section}.no_such_key=1", f"{section}.no_such_key") for section in sections]
    return cases


# What the issue saw as tracebacks or silent acceptance (issue 16, "What was seen"), kept by name.
SEEN = [("model=5", "model"), ("train.steps=1000000000000", "train.steps"),
        ("model.vocab_size=1099511627776", "model.vocab_size"),
        ("run.seed=1180591620717411303424", "run.seed"), ("moe.capacity_factor=nan", "moe.capacity_factor"),
        ("moe.capacity_factor=.inf", "moe.capacity_factor"), ("optimizer.lr=0", "optimizer.lr"),
        ("optimizer.warmup_steps=-1", "optimizer.warmup_steps"), ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio"),
        ("optimizer.b1=-0.1", "optimizer.b1"), ("optimizer.b1=1", "optimizer.b1"), ("optimizer.b2=1", "optimizer.b2"),
        ("optimizer.eps=0", "optimizer.eps"), ("optimizer.weight_decay=-1", "optimizer.weight_decay"),
        ("optimizer.clip_norm=-1", "optimizer.clip_norm"), ("model.rope_theta=0", "model.rope_theta"),
        ("model.norm_eps=-1", "model.norm_eps"), ("model.init_std=0", "model.init_std"), ("run.seed=-1", "run.seed"),
        ("moe.aux_loss_weight=-1", "moe.aux_loss_weight"), ("metrics.image_every=-1", "metrics.image_every"),
        ("metrics.peak_tflops=0", "metrics.peak_tflops"), ("checkpoint.keep=1000000000", "checkpoint.keep"),
        ("mesh.rules={embd: fsdp}", "mesh.rules.embd"), ("model.preset=../base", "model.preset"),
        ("mesh.tensor=3", "mesh.pipeline, mesh.expert, mesh.tensor")]


def test_every_generated_bad_value_is_a_config_error_naming_its_key():
    cases = generated_cases() + SEEN
    started = time.perf_counter()
    missed = []
    for override, key in cases:
        try:
            load(QUICKSTART, [override])
            missed.append(f"{override}: accepted")
        except ConfigError as error:
            if not any(problem == key or problem.startswith(key + "[") for problem, _ in error.problems):
                missed.append(f"{override}: names {[problem for problem, _ in error.problems]}, not {key}")
    elapsed = time.perf_counter() - started
    assert not missed, "\n".join(missed)
    assert len(cases) > 300 and elapsed < 20, (len(cases), elapsed)


# What issue 41 saw as tracebacks, hangs or silent acceptance (items 6 and 8), by overrides of the quickstart.
ISSUE_41 = [(["train.seq_len=2147483647"], "train.seq_len"),  # an OverflowError in the MoE layer
            (["train.seq_len=2147483646", "train.global_batch=1"], "moe.top_k"),
            (["moe.capacity_factor=1e30"], "moe.capacity_factor"),  # an OverflowError
            (["moe.eval_capacity_factor=1e30"], "moe.eval_capacity_factor"),
            (["model.dtype=float16"], "model.dtype"),  # XLA:CPU's dot_general traceback
            (["eval.steps=2147483647", "eval.every=10", "eval.source=synthetic"], "eval.steps")]  # a hang


def test_issue_41_cases_are_config_errors_naming_their_key():
    missed = []
    for overrides, key in ISSUE_41:
        try:
            load(QUICKSTART, overrides)
            missed.append(f"{overrides}: accepted")
        except ConfigError as error:
            names = [name for problem, _ in error.problems for name in problem.split(", ")]
            if key not in names:
                missed.append(f"{overrides}: names {names}, not {key}")
    assert not missed, "\n".join(missed)


def test_an_accelerator_jax_does_not_have_is_named_before_the_device_count():
    for accelerator in ("gpu", "tpu"):  # the error named cluster.devices_per_host
        with pytest.raises(ConfigError) as caught:
            select_devices(load(QUICKSTART, [f"cluster.accelerator={accelerator}"]))
        [(key, message)] = caught.value.problems
        assert key == "cluster.accelerator" and "set cluster.accelerator=cpu" in message, message


# Keys issue 41 saw silently accepted in a mode that never reads them: valid, so a warning, not an error.
IDLE = [(["cluster.tpu_topology=2x2x2", "cluster.tpu_type=TPU-V4"], ["cluster.tpu_topology", "cluster.tpu_type"]),
        (["cluster.launcher=inprocess", "cluster.max_failures=5"], ["cluster.max_failures"]),
        (["mesh.pipeline=1", "mesh.data=2", "pipeline.schedule=1f1b"], ["pipeline.microbatches", "pipeline.schedule"]),
        (["pipeline.schedule=circular", "pipeline.microbatches=1"], ["pipeline.schedule"]),  # repeats=1: gpipe
        (["moe.num_experts=0", "moe.every=0", "moe.top_k=1", "moe.router=sigmoid"], ["moe.top_k", "moe.router"]),
        (["data.source=synthetic", "data.paths=[a.txt]"], ["data.paths"])]


def test_keys_that_do_nothing_in_the_run_are_named_in_one_warning_line():
    assert idle_warning(load(QUICKSTART)) is None
    for overrides, keys in IDLE:
        warning = idle_warning(load(QUICKSTART, overrides))
        assert warning is not None and "\n" not in warning, overrides
        named = [key for group, _ in idle_keys(load(QUICKSTART, overrides)) for key in group]
        assert named == keys and all(key in warning for key in keys), (overrides, warning)


def test_the_cli_prints_the_warning_once_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_explain", lambda config, args: 0)  # the warning comes before the command runs
    assert cli.main(["explain", QUICKSTART, *IDLE[1][0]]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "nestor: warning: these keys do nothing in this run: cluster.max_failures (cluster.launcher=inprocess: they "
        "configure the Ray launcher)"]


@pytest.mark.parametrize("override, key", [("model.num_layers=1000000", "model.num_layers"),
                                           ("model.embed_dim=1073741824", "model.embed_dim"),
                                           ("moe.num_experts=65536", "moe.num_experts")])
def test_a_state_no_device_holds_is_refused_before_anything_is_allocated(override, key, monkeypatch):
    """Issue 41, item 8: these passed validation and `train` started allocating. The train state's layout is
    abstract (nothing allocated), so the job refuses it against the host's RAM on CPU (16 GiB here)."""
    monkeypatch.setattr(memory_fit, "host_memory_gib", lambda: 16.0)
    live = sum(array.nbytes for array in jax.live_arrays())
    with pytest.raises(ConfigError) as caught:
        build_job(load(QUICKSTART, [override]))
    [(named, message)] = caught.value.problems
    assert named == key and "the 2.0 GiB each of this host's 8 CPU devices has of its 16.0 GiB of RAM" in message
    assert sum(array.nbytes for array in jax.live_arrays()) - live < 2**20


def test_a_new_key_is_fuzzed_from_its_declaration():
    spec = Key("a made-up fraction", minimum=0, maximum=1)
    assert bad_values(float, spec) == ["fast", ".nan", ".inf", "-.inf", "-1", "1.5"]
    assert bad_values(int, Key("a degree", minimum=1, also=(-1,))) == ["fast", str(2**70), str(INT32_MAX + 1), "0"]


# Ten levels of ten aliases each: 10^10 values once expanded (issue 41 saw a MemoryError after 100 s).
ALIAS_BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 10)}]\n" for level in range(1, 10))


def _bad_files(tmp_path: Path) -> dict[str, str]:
    """Returns the config files the issues saw as tracebacks, hangs or silence, by what is wrong with them."""
    (tmp_path / "latin1.yaml").write_bytes("run:\n  dir: caf\xe9\n".encode("latin-1"))
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "broken.yaml").write_text("run: [dir\n")
    (tmp_path / "scalar.yaml").write_text("5\n")
    (tmp_path / "directory.yaml").mkdir()
    os.mkfifo(tmp_path / "fifo.yaml")  # reading it would wait for a writer forever
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")  # endless
    (tmp_path / "huge.yaml").write_text("# " + "x" * 2**20 + "\n")
    (tmp_path / "bomb.yaml").write_text(ALIAS_BOMB)
    (tmp_path / "recursive.yaml").write_text("model:\n  args: &args {inner: *args}\n")
    (tmp_path / "repeated_key.yaml").write_text("train:\n  steps: 5\n  seq_len: 32\n  steps: 6\n")
    (tmp_path / "repeated_section.yaml").write_text("train:\n  steps: 5\nmodel:\n  preset: tiny\ntrain:\n  seq_len: 32\n")
    return {name: str(tmp_path / f"{name}.yaml") for name in BAD_FILES}


BAD_FILES = {"latin1": "is not UTF-8 text", "empty": "write `{}`", "broken": "is not valid YAML",
             "scalar": "must hold a mapping", "directory": "is a directory", "fifo": "is not a regular file",
             "zero": "is not a regular file", "huge": "is larger than 1024 KiB",
             "bomb": "expands to more than 100,000 values", "recursive": "expands to more than 100,000 values",
             "repeated_key": "train.steps is written twice (lines 2 and 4)",
             "repeated_section": "train is written twice (lines 1 and 5)"}


def test_bad_config_files_are_one_line_errors_naming_the_config(tmp_path):
    started = time.perf_counter()
    for name, path in _bad_files(tmp_path).items():
        with pytest.raises(ConfigError) as caught:
            load(path)
        [(key, message)] = caught.value.problems
        assert key == "CONFIG" and path in message and BAD_FILES[name] in message and "\n" not in message, message
        with pytest.raises(ConfigError) as caught:
            load(QUICKSTART, [path])  # a further layer (an empty one was taken for no settings)
        [(key, message)] = caught.value.problems
        assert key == path and BAD_FILES[name] in message and "\n" not in message, message
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("override, key, message", [
    (".train.steps=5", ".train.steps", "write train.steps=5"),
    ("train..steps=5", "train..steps", "write train.steps=5"),
    ("model.args=" + ALIAS_BOMB.replace("\n", ", ").join("{}"), "model.args", "expands to more than 100,000"),
    ("mesh.rules={embed: null, embed: fsdp}", "mesh.rules", "embed is written twice")])
def test_overrides_with_an_empty_name_a_repeated_key_or_an_alias_bomb_name_the_override(override, key, message):
    with pytest.raises(ConfigError) as caught:
        load(QUICKSTART, [override])
    [(named, text)] = caught.value.problems
    assert named == key and message in text, caught.value.problems


def _console_script() -> list[str]:
    script = Path(sys.executable).parent / "nestor"
    return [str(script)] if script.exists() else [sys.executable, "-m", "nestor.orchestrator.commands.cli"]


def _exit_2_naming(runs: list[tuple[list[str], str]], cwd: Path) -> None:
    """Runs the console script with each argument list at once; asserts each exits 2 with one problem,
    naming its key, and no traceback."""
    env = child_env()  # PYTHONPATH: this checkout before the editable install
    started = time.perf_counter()
    processes = [(subprocess.Popen([*_console_script(), *args], cwd=cwd, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE), key) for args, key in runs]
    for process, key in processes:
        _, stderr = ended(process, 100)
        assert process.returncode == 2, stderr[-2000:]
        assert f"  {key}: " in stderr and "Traceback" not in stderr, stderr[-2000:]
        problem = stderr.strip().splitlines()[-2:]  # "invalid config:" and the one problem, after any jax warning
        assert problem[0] == "nestor: invalid config:" and problem[1].startswith(f"  {key}: "), stderr
    assert time.perf_counter() - started < 90  # 4 processes at once; ~25 s on 2 loaded cores


@pytest.mark.timeout(120)
def test_the_console_script_exits_2_naming_the_key_without_a_traceback(tmp_path):
    files = _bad_files(tmp_path)
    _exit_2_naming([(["explain", QUICKSTART, "model=5"], "model"),
                    (["explain", QUICKSTART, "moe.capacity_factor=.nan"], "moe.capacity_factor"),
                    (["train", QUICKSTART, "run.seed=1180591620717411303424"], "run.seed"),
                    (["train", files["directory"]], "CONFIG")], tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_console_script_exits_2_for_issue_41s_tracebacks_and_hangs(tmp_path):
    """A FIFO as the config hung; float16 on CPU, an accelerator jax does not have and a state no host holds
    got as far as XLA or the allocator."""
    inprocess = "cluster.launcher=inprocess"
    _exit_2_naming([(["train", _bad_files(tmp_path)["fifo"]], "CONFIG"),
                    (["train", QUICKSTART, inprocess, "model.dtype=float16"], "model.dtype"),
                    (["train", QUICKSTART, inprocess, "cluster.accelerator=gpu"], "cluster.accelerator"),
                    (["train", QUICKSTART, inprocess, "model.num_layers=1000000"], "model.num_layers")], tmp_path)


# Issue 58's kinds: damaged Hugging Face directories, broken arrays, factories and the user's code raising. Each
# case is generated from a seed and run through the CLI's `main` in process; each must exit 2 without a traceback
# of nestor's (0 tracebacks, 0 silent accepts).
FUZZ_RUN = ("cluster.launcher=inprocess", "cluster.devices_per_host=8", "train.steps=1", "train.global_batch=8",
            "train.seq_len=16", "data.source=synthetic", "metrics.tensorboard=false")
FIXTURES_HF = ROOT.parent / "shared" / "fixtures" / "hf"
BAD_JSON = [None, -1, 0, 2.5, "abc", [], {}, True, float("nan"), 10**30]


def _hf_damages(rng) -> list[tuple[str, object]]:
    """Returns (name, damage(directory)) for seeded random damage to a copy of the llama3 fixture."""
    from nestor.orchestrator.hf.architectures import FIELDS
    from tests.test_hf_damage import WEIGHTS, edit_header, read_header, write_header

    def config_field(field, value):
        def damage(directory):
            config = json.loads((directory / "config.json").read_text())
            if value is None:
                config.pop(field, None)
                config.get("rope_parameters", {}).pop(field, None)
            else:
                config[field] = value
            (directory / "config.json").write_text(json.dumps(config))
        return damage

    def header_field(tensor, field, value):
        def damage(directory):
            edit_header(directory / WEIGHTS, lambda h: {**h, tensor: {k: v for k, v in {**h[tensor], field: value}.items()
                                                                      if v is not None}})
        return damage

    def cut(fraction):
        return lambda directory: (directory / WEIGHTS).write_bytes(
            (directory / WEIGHTS).read_bytes()[:int((directory / WEIGHTS).stat().st_size * fraction)])

    def swapped_offsets(first, second):
        def damage(directory):
            header, data = read_header(directory / WEIGHTS)
            header[first]["data_offsets"] = header[second]["data_offsets"]
            write_header(directory / WEIGHTS, header, data)
        return damage

    required = [field for field, (needed, _, _) in FIELDS.items() if needed]
    tensors = sorted(name for name in read_header(FIXTURES_HF / "llama3" / WEIGHTS)[0] if name != "__metadata__")
    cases = []
    for _ in range(12):
        field = str(rng.choice(required))
        value = BAD_JSON[int(rng.integers(len(BAD_JSON)))]
        if value in (True,) or (value == 2.5 and field == "rms_norm_eps"):
            value = "abc"
        cases.append((f"config.json {field}={value!r}", config_field(field, value)))
    for _ in range(8):
        tensor = str(rng.choice(tensors))
        field = str(rng.choice(["dtype", "shape", "data_offsets"]))
        value = {"dtype": ["I64", "BOOL", "U8", "F7", 5, None], "shape": [[3], [-1], "x", None, [10**6]],
                 "data_offsets": [[5, 1], [0], "x", None, [0, 10**12]]}[field][int(rng.integers(5))]
        cases.append((f"{tensor} {field}={value!r}", header_field(tensor, field, value)))
    for fraction in rng.uniform(0.0, 0.99, 4):
        cases.append((f"cut to {fraction:.2f}", cut(float(fraction))))
    first, second = rng.choice(tensors, 2, replace=False)
    cases.append((f"{first} on {second}'s bytes", swapped_offsets(str(first), str(second))))
    return cases


def _assert_refused(code: int, err: str, case: str) -> None:
    assert code == 2, (case, err[-2000:])  # a silent accept trains or explains: exit 0
    assert "Traceback (most recent call last)" not in err, (case, err[-2000:])


def test_damaged_hugging_face_directories_are_refused_by_explain_without_a_traceback(tmp_path, capsys):
    import numpy as np

    from tests.test_hf import copy_of

    for index, (case, damage) in enumerate(_hf_damages(np.random.default_rng(58))):
        source = copy_of("llama3", tmp_path / str(index))
        damage(source)
        code = cli.main(["explain", str(_run_yaml(tmp_path)), f"model.init_from={source}", *FUZZ_RUN])
        _assert_refused(code, capsys.readouterr().err, case)


def _run_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  seed: 0\n")
    return path


FUZZ_FACTORIES = '''
import numpy as np

def returns(split, kind):
    return {"list": [1, 2], "none": None, "string": "rows", "empty": {}, "scalars": {"x": 1.0, "y": 2},
            "ragged": {"x": [[1.0], [2.0, 3.0]], "y": [0, 1]}, "objects": {"x": np.array([{}, {}]), "y": [0, 1]},
            "strings": {"x": np.array(["a", "b"]), "y": np.array([0, 1])}}[kind]

def raises(split, kind):
    raise {"runtime": RuntimeError, "index": IndexError, "key": KeyError, "os": OSError, "zero": ZeroDivisionError,
           "assertion": AssertionError, "type": TypeError, "value": ValueError}[kind]("the user's bug")
'''
FACTORY_KINDS = {"returns": ["list", "none", "string", "empty", "scalars", "ragged", "objects", "strings"],
                 "raises": ["runtime", "index", "key", "os", "zero", "assertion", "type", "value"]}


def _user_project(tmp_path: Path, monkeypatch) -> Path:
    from nestor.cluster.connect import USER_CODE_ENV
    from tests.test_user_model import write_user_directory

    directory = write_user_directory(tmp_path / "project")
    for module in ("mlp", "fuzz_factories", "fuzz_model"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.chdir(directory)
    monkeypatch.setenv(USER_CODE_ENV, str(directory))
    (directory / "fuzz_factories.py").write_text(FUZZ_FACTORIES)
    return directory


def test_broken_arrays_factories_and_raising_user_code_exit_2_without_nestors_traceback(tmp_path, monkeypatch,
                                                                                        capsys):
    import numpy as np

    from tests.test_user_model import MODEL, write_user_directory

    project = _user_project(tmp_path, monkeypatch)
    rng = np.random.default_rng(58)
    good = (project / "train.npz").read_bytes()
    runs = []
    for index, cut in enumerate(rng.integers(0, len(good) - 1, 6)):  # an .npz cut short anywhere
        (project / f"cut{index}.npz").write_bytes(good[:int(cut)])
        runs.append((f"npz cut to {cut} bytes", [f"data.paths=[cut{index}.npz]"]))
    for index, size in enumerate(rng.integers(1, 400, 3)):  # bytes that are no npz
        (project / f"noise{index}.npz").write_bytes(rng.bytes(int(size)))
        runs.append((f"{size} random bytes", [f"data.paths=[noise{index}.npz]"]))
    for shape, dtype in (([64], np.float32), ([64, 15], np.float32), ([64, 16, 1], np.float32),
                         ([63, 16], np.float64)):  # parts whose rows do not agree with train.npz's
        name = f"other{'x'.join(map(str, shape))}.npz"
        np.savez(project / name, x=np.zeros(shape, dtype), y=np.zeros(shape[:1], np.int32))
        runs.append((f"a part of rows {shape} {np.dtype(dtype)}", [f"data.paths=[train.npz, {name}]"]))
    for verb, kinds in FACTORY_KINDS.items():
        runs += [(f"factory {verb} {kind}", ["data.source=python", f"data.factory=fuzz_factories:{verb}",
                                             f"data.args={{kind: {kind}}}"]) for kind in kinds]
    for kind in ("RuntimeError", "IndexError", "KeyError", "OSError", "AssertionError", "ZeroDivisionError"):
        write_user_directory(project, f"fuzz_{kind.lower()}", MODEL.replace(
            "        self.embed = dense(", f"        raise {kind}('the user\\'s bug')\n        self.embed = dense("))
        runs.append((f"a constructor raising {kind}", [f"model.class=fuzz_{kind.lower()}:MLP"]))
    for case, overrides in runs:
        code = cli.main(["explain", "my.yaml", "cluster.launcher=inprocess", *overrides])
        err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True)
                      if not line.startswith("nestor: warning: "))  # data.paths with data.source=python
        _assert_refused(code, err, case)
        if "raising" in case or "raises" in case:  # the user's code raised: its frames, then the key
            assert err.startswith("Traceback (your code's frames; nestor's left out):\n"), (case, err)
            assert "orchestrator/" not in err and ("model.class" in err or "data.factory" in err), (case, err)
