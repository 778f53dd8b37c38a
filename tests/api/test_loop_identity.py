"""A Loop's run identity (issue 41): the code that made it, a script's top level included, and what a refusal says.

In one process at world 1: a script run with ``runpy`` makes its Loop at its top level, as ``python train.py`` does."""

from __future__ import annotations

import json
import runpy
import sys
import types

import pytest
import torch

import ddpkit
from ddpkit.errors import RunDirError
from ddpkit.identity import code_fingerprint
from ddpkit.loop import LoopConfig
from ddpkit.run.runkey import CodeKey

# A nanoGPT-style train.py: settings at the top, overrides by exec (its configurator), then values that differ
# between runs and ranks (the environment, the clock, a world-size-dependent batch), then the Loop.
SCRIPT = """
import os
import time

import torch

import ddpkit

learning_rate = 6e-4  # settings: set from constants
n_layer = 12
betas = (0.9, 0.95)
run_name = f"gpt-{{n_layer}}"
seed_offset = int(os.environ.get("SEED_OFFSET", "0"))  # the rank's: not a setting
world = int(os.environ.get("FAKE_WORLD", "1"))
batch_size = 8
batch_size //= world  # depends on the world size: an elastic resume changes it
t0 = time.time()
exec(open({config!r}).read())  # nanoGPT's configurator.py: overrides of the settings above
with ddpkit.Loop({run_dir!r}, log_every=1) as loop:
    lin = torch.nn.Linear(1, 1)
    loop.resume(lin=lin)
    for _ in loop.steps(2):
        pass
"""


def run_script(tmp_path, config: str, **env):
    (tmp_path / "configurator.py").write_text(config)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(config=str(tmp_path / "configurator.py"), run_dir=str(tmp_path / "r")))
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        mp.undo()


def starts(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "start"]


def test_a_script_level_loop_reads_settings_set_from_constants_and_config_not_per_run_or_per_rank_values(tmp_path):
    """Issue 41 case 8: a Loop made at a script's top level was "not read", so another model size or learning
    rate in the same run dir resumed (or failed in torch's load_state_dict). Now its code and its settings
    (globals set from constants, a configurator's overrides applied) are read; a changed one is refused in one
    line naming it, and what differs per run or rank (the environment, the clock, the world size) is not read."""
    run_script(tmp_path, "")
    code = json.loads((tmp_path / "r" / "loop.json").read_text())["code"]
    read = {k for k in code["parts"] if k.startswith("global ")}
    assert {"global learning_rate", "global n_layer", "global betas", "global run_name"} <= read
    assert not read & {"global seed_offset", "global world", "global batch_size", "global t0"}
    assert code["unproven"] == [] and code["parts"]["global learning_rate"] == "0.0006"
    assert "code train.py" in code["parts"]

    run_script(tmp_path, "", SEED_OFFSET="1", FAKE_WORLD="2")  # another rank's offset, another world: resumes
    assert starts(tmp_path / "r")[-1]["resumed_at_step"] == 2

    said = r"differs in: the loop's code in train\.py: global learning_rate 0\.0006 -> 0\.001 \(Loop\(check_code"
    with pytest.raises(RunDirError, match=said):
        run_script(tmp_path, "learning_rate = 1e-3\n")
    with pytest.raises(RunDirError, match=r"the loop's code in train\.py: global n_layer 12 -> 6, global run_name"):
        run_script(tmp_path, "n_layer = 6\nrun_name = f'gpt-{n_layer}'\n")
    run_script(tmp_path, "learning_rate = 6e-4\n")  # the same settings: resumes
    assert len(starts(tmp_path / "r")) == 3


def test_a_script_level_loop_whose_source_cannot_be_read_says_its_settings_are_not_read(tmp_path):
    """`python -c` or exec of a string: its code is read, and its settings are listed as not read."""
    src = SCRIPT.format(config=str(tmp_path / "configurator.py"), run_dir=str(tmp_path / "r"))
    (tmp_path / "configurator.py").write_text("")
    exec(compile(src, "<string>", "exec"), {"__name__": "__main__"})
    start = starts(tmp_path / "r")[0]
    assert "the settings of <string>: its source cannot be read" in start["not_read"]


LR = 1.0  # a module-level value the loop function below reads


def loop_reading_lr(run_dir: str, check_code: bool = True) -> None:
    with ddpkit.Loop(run_dir, log_every=1, check_code=check_code) as loop:
        loop.resume(lin=torch.nn.Linear(1, 1))
        for _ in loop.steps(2):
            torch.full((1,), LR)


def test_a_loop_refused_for_changed_code_names_the_part_as_trainer_does(tmp_path, monkeypatch):
    """Issue 41 case 7: the refusal said "the loop's code (parts; ...)" where Trainer names the part that differs
    (`global mynets.SCALE 1.0 -> 2.0`): it now says it in the same words."""
    run = str(tmp_path / "r")
    loop_reading_lr(run)
    monkeypatch.setattr(sys.modules[__name__], "LR", 2.0)
    said = r"the loop's code in loop_reading_lr: global [\w.]*\.LR 1\.0 -> 2\.0 \(Loop\(check_code=False\) resumes"
    with pytest.raises(RunDirError, match=said):
        loop_reading_lr(run)
    loop_reading_lr(run, check_code=False)  # as the refusal says


def loop_reading_the_environment(run_dir: str) -> None:
    import os

    with ddpkit.Loop(run_dir, log_every=1, save_every_steps=int(os.environ.get("SAVE_41", "0"))) as loop:
        loop.resume(lin=torch.nn.Linear(1, 1))
        for _ in loop.steps(2):
            pass


def test_the_environment_a_loop_reads_is_listed_not_compared_and_a_change_is_said(tmp_path, monkeypatch, capsys):
    """A loop's own code reads the environment for how to run (where to save, when to stop, a test's hook):
    it is said on the [start] line as not compared, and another value resumes. Regression (the porter's seed-000
    port): a rerun with LR=0.5 of an LR=0.01 run resumed silently at the snapshot's lr; a changed value is now
    said in one line, an unchanged one not."""
    run = tmp_path / "r"
    monkeypatch.setenv("SAVE_41", "1")
    loop_reading_the_environment(str(run))
    loop_reading_the_environment(str(run))  # the same value: nothing to say
    assert "SAVE_41" not in capsys.readouterr().err
    monkeypatch.setenv("SAVE_41", "2")
    loop_reading_the_environment(str(run))
    said = [line for line in capsys.readouterr().err.splitlines() if "SAVE_41" in line]
    assert len(said) == 1, said
    assert "os.environ['SAVE_41'] is '2' now; this run began with '1'" in said[0], said
    assert "step 2's snapshot is loaded as saved" in said[0] and "pass another run_dir" in said[0], said
    # Compared with the run's first values, not the last attempt's: said again at '2', not at '1' (a review finding)
    loop_reading_the_environment(str(run))
    assert "this run began with '1'" in capsys.readouterr().err
    monkeypatch.setenv("SAVE_41", "1")
    loop_reading_the_environment(str(run))
    assert "SAVE_41" not in capsys.readouterr().err
    first, _, third, _, _ = starts(run)
    assert third["resumed_at_step"] == 2
    assert "the environment the loop reads ('SAVE_41'): not compared on a resume; a change is said" in first["not_read"]


SCRIPT_41 = """
import torch
SCALE = 2.0
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
    def forward(self, x):
        return x * SCALE
def main(ctx):
    return Net()(torch.ones(1)) * SCALE
"""


def test_a_scripts_code_reads_the_same_in_a_launch_worker_as_in_the_script(tmp_path, monkeypatch):
    """Regression (the porter's seed-001 port): a Loop made in ``main(ctx)`` under ``ddpkit.launch`` was read in
    the workers as ``__mp_main__`` (multiprocessing's name for the script there) and at world 1 in the script's
    process as ``__main__``, so a resume at another world size was refused for "global __mp_main__.SCALE removed"
    and "closure __class__ __mp_main__.Net -> __main__.Net"."""
    script = tmp_path / "my_script.py"
    script.write_text(SCRIPT_41)
    read = []
    for name in ("__main__", "__mp_main__"):
        module = types.ModuleType(name)
        module.__file__ = str(script)  # the script as each process has it in sys.modules: yours, not a library's
        monkeypatch.setitem(sys.modules, name, module)
        exec(compile(SCRIPT_41, str(script), "exec"), module.__dict__)
        read.append(code_fingerprint("main", {"loop": module.main}, read_environ=False).parts)
    assert read[0] == read[1]
    assert "global __main__.SCALE" in read[0] and "code Net.forward" in read[0], read[0]  # the class read too


def test_a_snapshot_whose_code_was_not_read_is_matched_on_the_rest():
    """A snapshot of an older ddpkit's Loop made at a script's top level holds no code parts: it resumes, as then."""
    code = {"name": "train.py", "parts": {"code train.py": "ab"}, "unproven": []}
    key = CodeKey(LoopConfig(), code, LoopConfig.HASHED)
    older = {**key.to_dict(), "code": {"parts": {}, "unproven": ["the code that made the Loop (not a function)"]}}
    assert key.differing_keys(older) == []
    other = {**key.to_dict(), "code": {"parts": {"code train.py": "cd"}, "unproven": []}}
    assert key.differing_keys(other) == [
        "the loop's code in train.py: code train.py changed (Loop(check_code=False) resumes anyway)"
    ]
