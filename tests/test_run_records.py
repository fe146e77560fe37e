"""Runs never lose their history: resume from a stage folder, a second run into
the same folder, checkpoint integrity and pruning, and kill -9 at three points
of a stage (rollout, update, checkpoint write) followed by --resume, each
compared with a straight run (issue 13)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sat import strip_timing

from harness.cli import main as cli_main
from harness.cli import parse_args
from harness.run import run as run_sat
from harness.run_folder import latest_checkpoint, read_metrics, save_checkpoint, stage_key, verify_checkpoint

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--agents", "tiny x2", "--warmup-steps", "20", "--batch-size", "32", "--group-size", "4", "--eval-size", "16",
         "--epochs", "1", "--minibatch-size", "16", "--device", "cpu"]
QUIET = dict(log=lambda *_: None)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A straight 3-stage run: the reference every interrupted run must reproduce."""
    out = tmp_path_factory.mktemp("straight") / "run"
    return run_sat(parse_args(SMALL + ["--stages", "3", "--out", str(out)]), **QUIET), out


@pytest.mark.slow  # over 10 s on two busy cores: resumed runs
# -- resume from a stage folder keeps the run's history -------------------------------------------
def test_resume_from_a_stage_folder_keeps_rows_and_continues(straight, tmp_path):
    records, straight_out = straight
    out = tmp_path / "run"
    shutil.copytree(straight_out, out)  # the same 3-stage run (a fresh one equals it: the eval-every and kill tests)
    # rerun stage 3 from the stage-2 folder: rows 0..2 are kept, row 3 is recomputed identically
    resumed = run_sat(parse_args(["--resume", str(out / "checkpoints" / "stage_0002"), "--stages", "3"]), **QUIET)
    assert strip_timing(resumed) == strip_timing(records)
    assert strip_timing(read_metrics(out)) == strip_timing(records)
    # "resume" to the stage the folder already holds: nothing is rewritten, latest.json stays valid
    run_sat(parse_args(["--resume", str(out / "checkpoints" / "stage_0003"), "--stages", "3"]), **QUIET)
    assert [r["stage"] for r in read_metrics(out)] == [0, 1, 2, 3]
    assert latest_checkpoint(out).name == "stage_0003" and (latest_checkpoint(out) / "state.pt").exists()
    more = run_sat(parse_args(["--resume", str(out), "--stages", "4"]), **QUIET)
    assert [r["stage"] for r in more] == [0, 1, 2, 3, 4] and strip_timing(more[:4]) == strip_timing(records)


# -- a second run into the same folder is refused ---------------------------------------------------
def test_second_run_into_the_same_out_is_refused_and_changes_nothing(straight, capsys):
    _, out = straight
    before = snapshot(out)
    assert cli_main(SMALL + ["--stages", "1", "--out", str(out)]) != 0
    err = capsys.readouterr().err.strip()
    assert "already holds a run" in err and f"--resume {out}" in err and "--overwrite" in err and "\n" not in err
    assert snapshot(out) == before


def test_overwrite_replaces_the_run(tmp_path):
    out = tmp_path / "run"
    run_sat(parse_args(SMALL + ["--stages", "1", "--warmup-steps", "5", "--out", str(out)]), **QUIET)
    (out / "checkpoints" / "stage_0007").mkdir()  # debris of the old run must not survive
    again = run_sat(parse_args(SMALL + ["--stages", "0", "--warmup-steps", "5", "--out", str(out), "--overwrite"]),
                    **QUIET)
    assert [r["stage"] for r in again] == [0] and [r["stage"] for r in read_metrics(out)] == [0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["stage_0000"]
    assert not (out / "progress.png").exists()  # --stages 0 writes no plot (and no longer announces one)
    assert json.loads((out / "config.json").read_text())["overwrite"] is True
    # a later --resume does not inherit --overwrite (it would delete the run it resumes)
    assert parse_args(["--resume", str(out), "--stages", "1"]).overwrite is False


# -- checkpoints: pruning order and checksums ------------------------------------------------------
def test_pruning_keeps_the_new_folder_and_the_one_before_it(tmp_path, straight):
    _, run = straight
    team_dir = latest_checkpoint(run)
    import torch

    from harness.run_folder import load_checkpoint

    team, _, rng, controllers = load_checkpoint(team_dir, "cpu", torch.float32)
    out = tmp_path / "r"
    for stage in (5, 6):
        save_checkpoint(out, stage, team, controllers, {}, rng, {})
    save_checkpoint(out, 5, team, controllers, {}, rng, {}, suffix="_upgraded")
    assert sorted((p.name for p in (out / "checkpoints").iterdir()), key=lambda n: stage_key(Path(n))) == \
        ["stage_0005", "stage_0005_upgraded"]  # stage_0006 was a future the resumed run discards
    save_checkpoint(out, 0, team, controllers, {}, rng, {})  # the old bug: stage_0000 sorted first and was deleted
    assert latest_checkpoint(out).name == "stage_0000" and latest_checkpoint(out).is_dir()
    assert verify_checkpoint(latest_checkpoint(out)) is not None


def test_a_checkpoint_that_cannot_be_written_is_named_and_the_last_one_kept(tmp_path, straight, monkeypatch):
    _, run = straight
    import torch

    from harness import run_folder

    team, _, rng, controllers = run_folder.load_checkpoint(latest_checkpoint(run), "cpu", torch.float32)
    out = tmp_path / "r"
    save_checkpoint(out, 1, team, controllers, {}, rng, {})
    kept = snapshot(out)

    def full_disk(*_, **__):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_folder.torch, "save", full_disk)  # the disk, not the code under test, fails
    with pytest.raises(RuntimeError) as err:
        save_checkpoint(out, 2, team, controllers, {}, rng, {})
    message = str(err.value)
    assert "\n" not in message and "stage_0002" in message and "No space left on device" in message
    assert "GiB free" in message and f"--resume {out}" in message and "(stage 1)" in message
    assert snapshot(out) == kept  # no partial folder left behind, latest.json still at stage 1
    assert verify_checkpoint(latest_checkpoint(out)) is not None
    with pytest.raises(RuntimeError, match=r"rerun it with --overwrite \(no checkpoint of this run is complete\)"):
        save_checkpoint(tmp_path / "fresh", 0, team, controllers, {}, rng, {})


def test_a_damaged_file_is_named_and_the_previous_stage_offered(straight, tmp_path):
    _, run = straight
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    weights = copy / "checkpoints" / "stage_0003" / "team" / "agent_1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: same size, wrong contents
    weights.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"stage_0003 is damaged: team/agent_1/model.safetensors does not match its "
                                           r"checksum .*--resume .*stage_0002"):
        verify_checkpoint(copy / "checkpoints" / "stage_0003")
    assert verify_checkpoint(copy / "checkpoints" / "stage_0002") is not None


# -- a checkpoint is data, never code ----------------------------------------------------------------
class Planted:
    """Unpickled by a full unpickler, it would call open(path, "w"): what a shared state.pt could run instead."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_state_pt_carrying_a_callable_is_refused_in_one_line_and_nothing_runs(straight, tmp_path):
    """The checksums prove a file intact, not trustworthy: a state.pt with a pickled callable and checksums
    rewritten to match is refused before anything in it runs, and before any model loads."""
    _, run = straight
    import torch

    from harness import run_folder

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    folder, marker = latest_checkpoint(copy), tmp_path / "ran"
    state = torch.load(folder / "state.pt", weights_only=True)  # what a run writes is plain data
    torch.save({**state, "extra": Planted(marker)}, folder / "state.pt")
    (folder / run_folder.CHECKSUMS).write_text(json.dumps(run_folder.folder_digests(folder)))
    with pytest.raises(RuntimeError) as err:
        run_folder.load_checkpoint(folder, "cpu", torch.float32)
    message = str(err.value)
    assert "\n" not in message and f"checkpoint {folder} refused: state.pt" in message and "io.open" in message
    assert "start a new run" in message
    assert not marker.exists()


def test_numpy_rng_state_round_trips_through_plain_types():
    import numpy as np

    from harness.run_folder import numpy_rng_state, set_numpy_rng_state

    np.random.seed(7)
    np.random.normal()  # a cached Gaussian in the state too
    saved = numpy_rng_state()
    assert isinstance(saved[1], list) and all(isinstance(k, int) for k in saved[1][:3])
    expected = np.random.random(5), np.random.normal(size=3)
    set_numpy_rng_state(saved)
    again = np.random.random(5), np.random.normal(size=3)
    assert all((a == b).all() for a, b in zip(expected, again))


# -- kill -9 at three points of a stage, then resume -----------------------------------------------
class Watched:
    """sat.py in a subprocess; stdout and stderr collected into files we can poll."""

    def __init__(self, argv, folder: Path):
        self.out_path, self.err_path = folder / "stdout.txt", folder / "stderr.txt"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "sat.py", *argv], cwd=REPO, env=env,
                                     stdout=open(self.out_path, "w"), stderr=open(self.err_path, "w"))

    def stdout(self) -> str:
        return self.out_path.read_text()

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def kill_when(self, condition, timeout=900.0) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if condition():
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"sat.py ended before the kill point:\n{self.stdout()}\n{self.stderr()[-2000:]}")
            time.sleep(0.002)
        self.proc.kill()
        raise AssertionError("kill point never reached")


@pytest.mark.slow  # about a minute: three sat.py processes killed at chosen points, then a resume
def test_kill_9_in_rollout_update_and_checkpoint_write_then_resume_matches_a_straight_run(straight, tmp_path):
    records, _ = straight
    out = tmp_path / "run"
    argv = SMALL + ["--stages", "3", "--out", str(out)]
    resume = ["--resume", str(out), "--stages", "3"]

    # 1. rollout: the stage-1 line is printed and its checkpoint (written in the background) is on
    # disk; stage 2 runs its rollout
    run = Watched(argv, tmp_path)
    run.kill_when(lambda: any(line.split()[:1] == ["1"] for line in run.stdout().splitlines())
                  and (out / "latest.json").exists() and '"stage": 1' in (out / "latest.json").read_text())
    assert latest_checkpoint(out).name == "stage_0001"

    # 2. on resuming, before stage 2's checkpoint: the run's output is a file, so it draws no progress bar that
    # could name the agent being updated; the kill lands as soon as the resumed run says so
    (tmp_path / "second").mkdir()
    run = Watched(resume, tmp_path / "second")
    run.kill_when(lambda: "resumed from" in run.stdout())
    assert latest_checkpoint(out).name == "stage_0001"

    # 3. checkpoint write: the temporary stage folder exists, the rename has not happened
    (tmp_path / "third").mkdir()
    run = Watched(resume, tmp_path / "third")
    run.kill_when(lambda: (out / "checkpoints" / ".stage_0002.tmp").exists())
    assert (out / "checkpoints" / ".stage_0002.tmp").exists() and not (out / "checkpoints" / "stage_0002").exists()
    assert latest_checkpoint(out).name == "stage_0001"  # the previous stage is intact and resumable
    assert verify_checkpoint(latest_checkpoint(out)) is not None

    resumed = run_sat(parse_args(resume), **QUIET)
    assert strip_timing(resumed) == strip_timing(records)
    assert strip_timing(read_metrics(out)) == strip_timing(records)
    assert not list((out / "checkpoints").glob(".*tmp"))  # the torn folder is gone


# -- --eval-every N: fewer held-out evaluations, the same training -------------------------------------
@pytest.mark.slow  # over 10 s on two busy cores: a 3-stage run beside the straight one
def test_eval_every_keeps_the_training_and_certifies_across_skipped_stages(straight, tmp_path):
    """The held-out evaluation draws on an RNG stream of its own, so evaluating every 2 stages leaves
    every training figure as it is in the straight run; stage 0 and the last stage are always evaluated,
    an evaluated stage's figures equal the straight run's, and its certificate pairs it with the previous
    evaluation (the stages between included), whose rows it shares."""
    full, _ = straight
    out = tmp_path / "run"
    rows = run_sat(parse_args(SMALL + ["--stages", "3", "--eval-every", "2", "--out", str(out)]), **QUIET)
    assert [r["stage"] for r in rows] == [0, 1, 2, 3] and read_metrics(out) == rows
    assert ["eval_accuracy" in r for r in rows] == [True, False, True, True]  # 0, every 2nd, and the last
    assert "certificate" not in rows[1] and "violation" not in rows[1]
    training = ("team_reward", "agents", "order", "generations")
    for mine, ref in zip(strip_timing(rows), strip_timing(full)):
        assert {k: mine[k] for k in training if k in ref} == {k: ref[k] for k in training if k in ref}
        if "eval_accuracy" in mine:
            assert mine["eval_rewards"] == ref["eval_rewards"]
    two, three = rows[2], rows[3]
    assert two["certified_since_stage"] == 0 and three["certified_since_stage"] == 2
    assert two["certificate"]["mean_change"] == pytest.approx(two["eval_accuracy"] - rows[0]["eval_accuracy"], abs=1e-5)
    assert two["certificate"] == two["run_certificate"] | {"kind": two["certificate"]["kind"]}  # both since stage 0
    assert "since the evaluation of stage 0" in two["certificate"]["kind"]
    assert "since the previous row" in three["certificate"]["kind"]
    assert three["violation_rate"] == (two["violation"] + three["violation"]) / 2
    assert (out / "progress.png").stat().st_size > 1000
