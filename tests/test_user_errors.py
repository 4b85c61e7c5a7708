"""The user's code and data fail with their own error: arrays checked against each other and against the train
fields before anything compiles (explain included), and an exception raised in the user's code shown with
the user's frames only, then one line naming the key, exit 2."""

from __future__ import annotations

import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from nestor.cluster.connect import USER_CODE_ENV
from nestor.orchestrator.commands.cli import main
from tests.test_user_model import MODEL, UNNAMED, write_user_directory

MESH = ("cluster.launcher=inprocess", "cluster.devices_per_host=8", "train.steps=2")


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """The user's model of tests/test_user_model.py (a classifier of named arrays x, y) in a fresh directory."""
    directory = write_user_directory(tmp_path / "project")
    for module in ("mlp", "factories", "broken", "lossy"):  # another test's project imported them
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.chdir(directory)
    monkeypatch.setenv(USER_CODE_ENV, str(directory))
    return directory


def run(command: str, capsys, *overrides: str) -> tuple[int, str]:
    code = main([command, "my.yaml", *MESH, *overrides])
    said = capsys.readouterr().err
    return code, "".join(line for line in said.splitlines(keepends=True) if not line.startswith("nestor: warning: "))


def one_config_line(code: int, err: str, key: str, says: str) -> None:
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.startswith("nestor: invalid config:\n") and f"  {key}: " in err and says in err, err


def rows(n: int = 64, features: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(n, features)).astype(np.float32), "y": rng.integers(0, 4, n).astype(np.int32)}


def truncated(path: Path) -> None:
    np.savez(path, **rows())
    path.write_bytes(path.read_bytes()[:300])


def pickled(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (64,), }"
                                  .ljust(127) + b"\n" + pickle.dumps(np.array([{}] * 64, dtype=object)))
        archive.writestr("y.npy", b"")


ARRAY_DAMAGES = {  # how extra.npz is written -> (what the error says)
    "garbage": (lambda p: p.write_bytes(b"not a zip file at all" * 10), "does not read as numpy arrays"),
    "truncated": (truncated, "does not read as numpy arrays"),
    "pickled objects": (pickled, "does not read as numpy arrays"),
    "0-d fields": (lambda p: np.savez(p, x=np.float32(1), y=np.int32(2)), "is a single value ()"),
    "strings": (lambda p: np.savez(p, x=np.array(["a"] * 64), y=rows()["y"]), "holds <U1 values"),
    "other trailing shapes": (lambda p: np.savez(p, **rows(features=8)), "has rows of (8,) float32"),
    "another field": (lambda p: np.savez(p, x=rows()["x"], z=rows()["y"]), "holds the fields ['x', 'z']"),
}


@pytest.mark.parametrize("damage", ARRAY_DAMAGES)
def test_damaged_array_files_are_one_config_error_naming_the_file_in_explain_and_train(project, capsys, damage):
    write, says = ARRAY_DAMAGES[damage]
    write(project / "extra.npz")
    for command in ("explain", "train"):
        code, err = run(command, capsys, "data.paths=[train.npz, extra.npz]")
        one_config_line(code, err, "data.paths", says)
        assert "extra.npz" in err, err


def test_eval_arrays_of_other_fields_or_shapes_are_refused_before_anything_compiles(project, capsys):
    np.savez(project / "eval_fields.npz", x=rows()["x"], label=rows()["y"])
    np.savez(project / "eval_shapes.npz", **rows(features=12))
    for path, says in (("eval_fields.npz", "holds the fields ['label', 'x'], the training data ['x', 'y']"),
                       ("eval_shapes.npz", "eval_shapes.npz has rows of (12,) float32, the training data's of (16,) float32")):
        code, err = run("explain", capsys, "eval.every=1", "eval.source=arrays", f"eval.paths=[{path}]")
        one_config_line(code, err, "eval.paths", says)


FACTORIES = '''
import numpy as np

def raises(split):
    return load(split)

def load(split):
    raise FileNotFoundError(f"/data/{split}.bin")

def a_list(split):
    return [1, 2, 3]

def scalars(split):
    return {"x": 1.0, "y": 2}

def ragged(split):
    return {"x": [[1.0, 2.0], [3.0]], "y": [0, 1]}

def no_eval(split):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    return {"x": x, "y": (x[:, 0] > 0).astype(np.int32)} if split == "train" else {"x": x}
'''


@pytest.mark.parametrize("factory, key, says", [
    ("a_list", "data.factory", "returned list; it must return a dict of named arrays"),
    ("scalars", "data.paths", ""),  # named below: 0-d fields
    ("ragged", "data.factory", "makes no array"),
    ("no_eval", "data.factory", "no_eval(split='eval') holds the fields ['x'], the training data ['x', 'y']"),
])
def test_a_factory_returning_no_rows_of_numbers_is_one_config_error(project, capsys, factory, key, says):
    (project / "factories.py").write_text(FACTORIES)
    extra = ("eval.every=1",) if factory == "no_eval" else ()
    code, err = run("explain", capsys, "data.source=python", f"data.factory=factories:{factory}", *extra)
    if factory == "scalars":
        one_config_line(code, err, "data.factory", "field x of factories:scalars(split='train') is a single value")
    else:
        one_config_line(code, err, key, says)


def assert_users_frames_then_one_line(code: int, err: str, file: str, line: str, names: str) -> None:
    lines = err.splitlines()
    assert code == 2 and lines[0] == "Traceback (your code's frames; nestor's left out):", err
    assert f'{file}", line' in err and line in err, err
    assert "orchestrator" not in err.replace(names, "") and "site-packages" not in err, err  # nestor's left out
    assert names in lines[-1] and "Traceback" not in "\n".join(lines[1:]), lines[-1]  # one key line ends it


def test_a_factory_that_raises_shows_the_users_frames_and_names_data_factory(project, capsys):
    (project / "factories.py").write_text(FACTORIES)
    code, err = run("train", capsys, "data.source=python", "data.factory=factories:raises")
    assert_users_frames_then_one_line(code, err, "factories.py", 'raise FileNotFoundError(f"/data/{split}.bin")',
                                      "data.factory")
    assert "return load(split)" in err and "FileNotFoundError: /data/train.bin" in err


def test_a_model_whose_constructor_or_loss_raises_shows_the_users_frames_and_names_model_class(project, capsys):
    write_user_directory(project, "broken", MODEL.replace(
        "        self.embed = dense(", "        open('/nonexistent/weights.bin')\n        self.embed = dense("))
    code, err = run("train", capsys, "model.class=broken:MLP")
    assert_users_frames_then_one_line(code, err, "broken.py", "open('/nonexistent/weights.bin')", "model.class")
    write_user_directory(project, "lossy", MODEL.replace('batch["y"]).mean()', 'batch["label"]).mean()'))
    for command in ("explain", "train"):
        code, err = run(command, capsys, "model.class=lossy:MLP")
        assert_users_frames_then_one_line(code, err, "lossy.py", 'batch["label"]', "which your code reads")
        assert "KeyError: 'label'\nnestor: invalid config:\n  model.class: your code (model.class lossy:MLP) " \
               "raised KeyError: 'label'\n  data.paths: " in err, err
        assert err.endswith("train.npz hold the fields x, y, not 'label', which your code reads\n"), err


def test_an_empty_stack_is_a_model_args_error(project, capsys):
    code, err = run("explain", capsys, "model.args={depth: 0}")
    assert code == 2 and "model.args: mlp:MLP's MLPConfig cannot be built from {'width': 32, 'hidden': 64, " \
                         "'depth': 0}" in err, err
    assert "Stack 'blocks' needs a count of at least one block, got 0" in err


def test_from_the_checkout_or_beside_pythons_library_only_the_users_own_files_are_the_users(monkeypatch, tmp_path):
    """Run from the checkout (the README's cwd, where an editable install maps `nestor.orchestrator` to
    `orchestrator/`), nestor's frames are nestor's and a model file beside them the user's; run from a
    directory that holds Python's library, its frames are not the user's."""
    import contextlib
    import importlib.util

    from nestor.orchestrator import user_code
    from tests.settings import ROOT

    monkeypatch.setenv(USER_CODE_ENV, str(ROOT))
    assert not user_code._is_users(str(ROOT / "orchestrator" / "loop" / "train.py"))
    assert not user_code._is_users(str(ROOT / "nestor" / "__init__.py"))
    assert user_code._is_users(str(ROOT / "my_model.py"))
    library = Path(contextlib.__file__).resolve()
    monkeypatch.setenv(USER_CODE_ENV, str(library.parent.parent))
    assert not user_code._is_users(str(library))
    assert importlib.util.find_spec("nestor.orchestrator").submodule_search_locations  # what the rooms come from


RAY = ("cluster.launcher=ray", "cluster.hosts=2", "cluster.devices_per_host=4", "mesh.data=2", "mesh.fsdp=2",
       "mesh.tensor=2")
LOGITS = MODEL.replace("        return loss, {", "        return logits\n        return loss, {")


@pytest.mark.parametrize("overrides, says", [
    (("model.args.hidden=63",), "its 'mlp' dimension of 63 does not split over mesh.tensor (= 2)"),
    (("model.class=logits:MLP",), "MLP.loss(batch) returned an array float32 (16, 4); it must return"),
    (("model.class=lossy:MLP",), "raised KeyError: 'label'"),
    (("mesh.rules={cls: tensor}",), "the model never names 'cls'"),
    (("model.class=unnamed:MLP", "model.args.classes=4096", "cluster.device_memory_gb=0.001"),
     "its largest parameter, head [32, 4096], is 4,096 along a dimension without a logical name (replicated)"),
])
def test_a_mistake_in_the_users_model_is_refused_before_ray_starts(project, capsys, monkeypatch, overrides, says):
    from nestor.orchestrator.commands import ray_driver

    write_user_directory(project, "logits", LOGITS)
    write_user_directory(project, "unnamed", UNNAMED)
    write_user_directory(project, "lossy", MODEL.replace('batch["y"]).mean()', 'batch["label"]).mean()'))
    monkeypatch.setattr(ray_driver, "launch", lambda *args, **kwargs: pytest.fail("Ray was started"))
    code = main(["train", "my.yaml", *RAY, *overrides])
    err = capsys.readouterr().err
    assert code == 2 and "nestor: invalid config:\n" in err and says in err, err
    assert not (project / "runs").exists()  # nothing written: run.dir is not even made


def test_the_abstract_build_before_a_launch_touches_no_device(project):
    """The checks run with JAX_PLATFORMS naming a platform this machine lacks: any device touched fails."""
    from tests.settings import ROOT
    from tests.helpers import child_env

    check = ("import sys\nfrom nestor.orchestrator.loader.config import load\n"
             "from nestor.orchestrator.job.abstract_check import check_abstractly\n"
             "check_abstractly(load('my.yaml', sys.argv[1:]))\nprint('checked')\n")
    env = child_env(JAX_PLATFORMS="tpu", PYTHONPATH=str(ROOT))
    for overrides, said in (((), "checked\n"), (("model.args.hidden=63",), "does not split over mesh.tensor")):
        result = subprocess.run([sys.executable, "-c", check, *RAY[1:], *overrides], cwd=project, env=env,
                                capture_output=True, text=True, timeout=120)
        assert said in result.stdout + result.stderr and "Unable to initialize backend" not in result.stderr, \
            result.stderr[-3000:]


def test_replicated_parameters_that_make_the_state_not_fit_are_refused_by_the_fit_check(project, capsys):
    """A head of 32 x 4096 float32 (512 KiB) split over fsdp2 x tensor2 fits 1 MiB per device with AdamW's two
    moments; replicated for want of names, the same head does not."""
    write_user_directory(project, "unnamed", UNNAMED)
    sizes = ("model.args.classes=4096", "cluster.device_memory_gb=0.001", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    code, err = run("train", capsys, *sizes, "mesh.rules={classes: tensor}", "train.steps=1")
    assert code == 0, err
    code, err = run("train", capsys, *sizes, "model.class=unnamed:MLP", "run.dir=runs/unnamed")
    one_config_line(code, err, "model.args", "its largest parameter, head [32, 4096], is 4,096 along a dimension without a logical name (replicated)")


def test_a_kernel_only_the_workers_devices_can_judge_is_left_to_them(tiny_config):
    """Dropless MoE on Mosaic GPU's grouped matmuls for GPUs of no named kind: the driver, on CPU, cannot tell
    a Hopper from another GPU, so the check before the launch lays the model out and leaves the kernel to the
    workers, which judge it on their devices."""
    from nestor.backend import BackendError, resolve_backend
    from nestor.orchestrator.job.abstract_check import check_abstractly
    from nestor.orchestrator.job.step import backend_request

    config = tiny_config("cluster.accelerator=gpu", "moe.grouped_matmul=mosaic_gpu", "moe.capacity_factor=0",
                         "model.embed_dim=128", "moe.num_experts=4", "moe.every=1", "mesh.expert=1", "mesh.pipeline=1",
                         "mesh.tensor=1")
    with pytest.raises(BackendError):  # what a CPU driver would have refused the run for
        resolve_backend(backend_request(config), "cpu", None, None, 1)
    check_abstractly(config)  # refused the run before: a BackendError became a ConfigError
