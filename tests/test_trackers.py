"""The trackers of ``--report-to`` (harness/trackers.py), each read back through its own reader from what it wrote:
TensorBoard's event files, W&B's offline transaction log and table file, MLflow's file store (its own client),
trackio's local project (its own storage). A sample holds a multi-round transcript of some 15,000 characters,
which must arrive whole and unchanged. W&B, MLflow and trackio each run in a fresh process whose home, working
folder and temporary folder are empty folders and whose sockets refuse the network: nothing may be sent, and
nothing written outside the run folder. Their tests skip only where the package is missing (.ci/run installs
requirements-trackers.txt)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import trackers  # noqa: E402

ROW = {"stage": 2, "team_reward": 0.25, "agent_reward": [0.5, 0.0], "eval_rewards": [1.0] * 64, "kind": "cpu",
       "agents": [{"kl_quantile": 0.01, "accepted": True, "step_bound": None},
                  {"kl_quantile": 0.02, "accepted": False}],
       "certificate": {"lower_bound": -0.1, "n": 64}, "eval_accuracy": math.nan}
FIRST = {**ROW, "stage": 0, "team_reward": 0.125, "agent_reward": [0.25, 0.75]}
TRANSCRIPT = "\n".join(f"Agent {1 + r % 2}: round {r}, I move the\tpiece to ({r}, {2 * r}) | \"hold\" — naïve ✓\n"
                       f"Environment: observation {r}: " + "wall " * 60 for r in range(40))  # trailing spaces too
SAMPLES = [{"stage": 2, "problem": "1+1", "gold": "2", "team_answer": "2", "reward": 1.0,
            "agents": [{"response": "2", "answer": "2"}, {"response": "it is\n3 | 2", "answer": "2"}]},
           {"stage": 2, "problem": "Play the grid game to the end.", "gold": "win", "team_answer": "win", "reward": 0.5,
            "agents": [{"response": TRANSCRIPT, "answer": "win"}, {"response": "", "answer": "None"}]}]
CONFIG = {"agents": "tiny x2", "lr": 3e-4}


def installed(name: str):
    return pytest.mark.skipif(importlib.util.find_spec(name) is None,
                              reason=f"{name} not installed (pip install -r requirements-trackers.txt)")


def expected_scalars() -> list[dict[str, float]]:
    return [trackers.finite(trackers.flatten(row)) for row in (FIRST, ROW)]


def test_the_transcript_is_long_and_the_table_keeps_it_whole():
    assert len(TRANSCRIPT) > 15_000 and TRANSCRIPT.count("\nEnvironment: ") == 40
    columns, rows = trackers.sample_table(SAMPLES)
    assert rows[1][columns.index("agent_1_response")] == TRANSCRIPT


def test_report_to_parses_and_refuses_a_missing_package(monkeypatch):
    assert trackers.parse_report_to("none") == ()
    assert trackers.parse_report_to("TensorBoard, wandb,tensorboard") == ("tensorboard", "wandb")
    for bad, expected in (("tensorbored", "unknown tracker 'tensorbored'"), ("none,wandb", "none cannot be combined")):
        with pytest.raises(ValueError) as err:
            trackers.parse_report_to(bad)
        assert expected in str(err.value) and "\n" not in str(err.value)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(RuntimeError) as err:
        trackers.Trackers(("tensorboard", "mlflow"), "never-made", {})
    assert str(err.value) == ("--report-to mlflow needs the package mlflow-skinny, which is not installed: "
                              "pip install mlflow-skinny (or drop it from --report-to)")
    assert not Path("never-made").exists()  # refused before any work


def test_flatten_keeps_the_scalars_of_a_metrics_row():
    flat = trackers.flatten(ROW)
    assert math.isnan(flat.pop("eval_accuracy"))  # kept here; trackers.finite drops it before logging
    assert flat == {"stage": 2.0, "team_reward": 0.25, "agent_reward/1": 0.5, "agent_reward/2": 0.0,
                    "agents/1/kl_quantile": 0.01, "agents/1/accepted": 1.0, "agents/2/kl_quantile": 0.02,
                    "agents/2/accepted": 0.0, "certificate/lower_bound": -0.1, "certificate/n": 64.0}


def test_the_environment_is_set_while_a_tracker_is_open_and_the_users_own_value_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_CACHE_DIR", "/mine")
    for name in ("WANDB_DATA_DIR", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    before = trackers.set_env(trackers.tracker_env("wandb", tmp_path))
    assert os.environ["WANDB_CACHE_DIR"] == "/mine" and os.environ["WANDB_MODE"] == "offline"
    assert os.environ["WANDB_DATA_DIR"] == str(tmp_path.resolve() / "wandb" / "data")
    trackers.restore_env(before)
    assert os.environ["WANDB_CACHE_DIR"] == "/mine" and "WANDB_DATA_DIR" not in os.environ


# -- TensorBoard (in this process: torch's SummaryWriter writes only where it is told) ------------------------
def test_tensorboard_scalars_and_samples_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = trackers.Trackers(trackers.parse_report_to("tensorboard"), tmp_path, CONFIG)
    run.log_stage(FIRST, [])
    run.log_stage(ROW, SAMPLES)
    run.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("team_reward")] == [(0, 0.125), (2, 0.25)]
    assert [e.value for e in events.Scalars("agents/2/kl_quantile")] == pytest.approx([0.02, 0.02])
    assert "eval_accuracy" not in events.Tags()["scalars"]  # NaN stays in metrics.jsonl
    text = [e for e in events.Tensors("samples/text_summary")]
    assert [e.step for e in text] == [2]
    markdown = text[0].tensor_proto.string_val[0].decode()
    assert "it is<br>3 \\| 2" in markdown and TRANSCRIPT.replace("|", "\\|").replace("\n", "<br>") in markdown


# -- W&B, MLflow, trackio: each in a fresh process, then read back ---------------------------------------------
WRITER = textwrap.dedent("""
    import ipaddress, json, socket, sys

    def local(host):
        try:
            return host in ("localhost", "") or ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def refuse(what, host):
        print(f"NETWORK: {what} {host}", file=sys.stderr, flush=True)
        raise OSError(f"this test allows no network: {host}")

    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *args, **kwargs):
        return real_getaddrinfo(host, *args, **kwargs) if local(str(host)) else refuse("getaddrinfo", host)

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not local(str(address[0])):
            refuse("connect", address[0])
        return real_connect(sock, address)

    socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect
    sys.path.insert(0, sys.argv[1])
    from harness import trackers

    name, run_dir, (config, first, row, samples) = sys.argv[2], sys.argv[3], json.load(sys.stdin)
    run = trackers.Trackers((name,), run_dir, config)
    run.log_stage(first, [])
    run.log_stage(row, samples)
    run.close()
""")


def isolated_env(outside: Path) -> dict[str, str]:
    """This process's environment less every tracker's and the hub's variables, less the CI and pytest markers
    (under which MLflow turns its telemetry off by itself), with home and temporary folder in ``outside``."""
    drop = ("WANDB_", "MLFLOW_", "TRACKIO_", "HF_", "XDG_", "GRADIO_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(drop) and k not in ("CI", "PYTEST_CURRENT_TEST", "DO_NOT_TRACK")}
    return {**env, "HOME": str(outside / "home"), "TMPDIR": str(outside / "tmp")}


def report_in_a_fresh_process(name: str, tmp_path: Path) -> Path:
    """Opens tracker ``name`` for <tmp_path>/run in a fresh process, sends FIRST with no samples and ROW with
    SAMPLES, closes; checks that it reached no network and wrote nothing outside the run folder."""
    outside, run_dir = tmp_path / "outside", tmp_path / "run"
    for folder in ("home", "cwd", "tmp"):
        (outside / folder).mkdir(parents=True)
    data = json.dumps([CONFIG, FIRST, ROW, SAMPLES])  # NaN included: trackers.finite drops it
    done = subprocess.run([sys.executable, "-c", WRITER, str(ROOT), name, str(run_dir)], input=data, text=True,
                          capture_output=True, cwd=outside / "cwd", env=isolated_env(outside), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NETWORK:" not in done.stderr, done.stderr[-3000:]
    written = sorted(str(p.relative_to(outside)) for p in outside.rglob("*") if not p.is_dir())
    assert written == [], written
    return run_dir


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (run-*.wandb): a 7-byte header (":W&B", 0xBEE1, version 0), then
    LevelDB-log framing in 32 KiB blocks, each chunk a 7-byte header (CRC-32, length, kind: 1 whole record,
    2 first, 3 middle, 4 last part) before its bytes; a block's last few bytes are padding."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:7] == b":W&B\xe1\xbe\x00"
    records, parts, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(parts))
            parts = b""
    return records


@installed("wandb")
def test_wandb_offline_run_reads_back_whole(tmp_path):
    run_dir = report_in_a_fresh_process("wandb", tmp_path)
    logs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    records = wandb_records(logs[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name) == ("sat", "run")
    assert {u.key: json.loads(u.value_json) for u in run.config.update if u.key in CONFIG} == CONFIG
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [0, 2]
    for logged, expected in zip(history, expected_scalars()):
        assert {k: logged[k] for k in expected} == pytest.approx(expected)
    table_file = logs[0].parent / "files" / history[1]["samples/path"]
    assert hashlib.sha256(table_file.read_bytes()).hexdigest() == history[1]["samples/sha256"]
    columns, rows = trackers.sample_table(SAMPLES)
    assert json.loads(table_file.read_text()) == {"columns": columns, "data": rows}


@installed("mlflow")
def test_mlflow_file_store_reads_back_whole(tmp_path, monkeypatch):
    run_dir = report_in_a_fresh_process("mlflow", tmp_path)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("sat").experiment_id])
    assert run.info.run_name == "run" and run.data.params == {k: str(v) for k, v in CONFIG.items()}
    for name in expected_scalars()[1]:
        history = client.get_metric_history(run.info.run_id, name)
        assert [m.step for m in history] == [0, 2]
        assert [m.value for m in history] == pytest.approx([scalars[name] for scalars in expected_scalars()])
    assert [a.path for a in client.list_artifacts(run.info.run_id, "samples")] == ["samples/stage_0002.json"]
    table = client.download_artifacts(run.info.run_id, "samples/stage_0002.json", str(tmp_path))
    columns, rows = trackers.sample_table(SAMPLES)
    assert json.loads(Path(table).read_text()) == {"columns": columns, "data": rows}


TRACKIO_READER = textwrap.dedent("""
    import json
    from trackio.sqlite_storage import SQLiteStorage

    print(json.dumps({"runs": SQLiteStorage.get_runs("sat"), "logs": SQLiteStorage.get_logs("sat", "run"),
                      "config": SQLiteStorage.get_run_config("sat", "run")}))
""")


@installed("trackio")
def test_trackio_local_project_reads_back_whole(tmp_path):
    run_dir = report_in_a_fresh_process("trackio", tmp_path)
    assert sorted(p.name for p in (run_dir / "trackio").iterdir()) == ["sat.db", "sat.lock"]
    env = {**isolated_env(tmp_path / "outside"), "TRACKIO_DIR": str(run_dir / "trackio")}  # its own reader
    done = subprocess.run([sys.executable, "-c", TRACKIO_READER], capture_output=True, text=True, env=env,
                          cwd=tmp_path / "outside" / "cwd", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    stored = json.loads(done.stdout.strip().splitlines()[-1])
    assert stored["runs"] == ["run"] and {k: stored["config"][k] for k in CONFIG} == CONFIG
    scalars = [log for log in stored["logs"] if "samples" not in log]
    assert [log["step"] for log in scalars] == [0, 2]
    for logged, expected in zip(scalars, expected_scalars()):
        assert {k: logged[k] for k in expected} == pytest.approx(expected)
    [table] = [log for log in stored["logs"] if "samples" in log]
    columns, rows = trackers.sample_table(SAMPLES)
    assert table["step"] == 2 and table["samples"]["_type"] == "trackio.table"
    assert [list(r) for r in table["samples"]["_value"]] == [columns] * 2
    assert [list(r.values()) for r in table["samples"]["_value"]] == rows


SECOND_TRACKIO = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from harness import trackers

    trackers.Trackers(("trackio",), sys.argv[2], {}).close()
    try:
        trackers.Trackers(("trackio",), sys.argv[3], {})
    except RuntimeError as err:
        print(err)
""")


@installed("trackio")
def test_a_second_trackio_run_folder_in_one_process_is_refused(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    (tmp_path / "outside" / "cwd").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", SECOND_TRACKIO, str(ROOT), str(first), str(second)], text=True,
                          capture_output=True, env=isolated_env(tmp_path / "outside"), cwd=tmp_path / "outside" / "cwd",
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == (
        f"--report-to trackio: this process's trackio writes to {first.resolve() / 'trackio'} (fixed when trackio was "
        f"first imported), not {second.resolve() / 'trackio'}; report one run folder per process")
    assert not (second / "trackio").exists()  # nothing written for the refused one
