"""``--report-to tensorboard,wandb,trackio,mlflow,none``: each stage's numbers and samples sent to the trackers
TRL and verl users read, beside metrics.jsonl.

Each backend is imported when it is opened, never before; ``check_report_to`` refuses a missing package in one
line naming its pip install before any work. A stage sends the scalars of its metrics row (``flatten``: team and
per-agent accuracy, KL quantiles, beta, bounds, timings; nested names joined with "/", agents numbered from 1)
and its samples as a table (``sample_table``), every text whole (a multi-round transcript included). Every tracker
writes inside the run folder and nowhere else, and reaches no network: W&B runs offline, MLflow to a file store,
trackio to a local project. Each reads its folders and switches from environment variables (``tracker_env``), set
while the tracker is open and restored when it closes; a variable the user set keeps the user's value.
"""
from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow-skinny"}  # pip name
CHOICES = (*PACKAGES, "none")
MAX_INDEXED = 16  # a list of numbers up to this long is one scalar per entry (per agent); longer ones are per-row data


def parse_report_to(spec: str) -> tuple[str, ...]:
    """The trackers of ``--report-to`` ("tensorboard,wandb", "none"), each named once."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in CHOICES]
    if unknown or not names:
        raise ValueError(f"--report-to {spec!r}: {('unknown tracker ' + repr(unknown[0])) if unknown else 'empty'}; "
                         f"choose from {', '.join(CHOICES)} (comma-separated)")
    if "none" in names and len(names) > 1:
        raise ValueError(f"--report-to {spec!r}: none cannot be combined with a tracker")
    return () if names == ("none",) else names


def check_report_to(names: tuple[str, ...]) -> None:
    """One line naming the pip install for the first tracker whose package is missing (before any work)."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise RuntimeError(f"--report-to {name} needs the package {PACKAGES[name]}, which is not installed: "
                               f"pip install {PACKAGES[name]} (or drop it from --report-to)")


def flatten(row: dict, prefix: str = "") -> dict[str, float]:
    """The scalars of a metrics row: numbers and booleans by their "/"-joined path; lists of dicts (per agent)
    and short lists of numbers numbered from 1; text, None and long lists (the per-row held-out rewards) left
    to metrics.jsonl."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (list, tuple)) and len(value) <= MAX_INDEXED:
            out.update(flatten({str(i + 1): v for i, v in enumerate(value)}, name + "/"))
        elif isinstance(value, (bool, int, float)):
            out[name] = float(value)
    return out


def sample_table(samples: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, rows) of a stage's samples (records.stage_samples): the problem, the gold answer, each agent's
    response and answer, the team's answer and reward; an environment's episode also its rounds and whole
    transcript."""
    if not samples:
        return [], []
    n_agents = len(samples[0]["agents"])
    episode = "transcript" in samples[0]
    columns = ["stage", "problem", "gold"] + [f"agent_{k + 1}_{f}" for k in range(n_agents)
                                              for f in ("response", "answer")] + ["team_answer", "reward"]
    rows = [[s["stage"], s["problem"], str(s["gold"])]
            + [str(a[f]) for a in s["agents"] for f in ("response", "answer")]
            + [str(s["team_answer"]), float(s["reward"])] + ([s["rounds"], s["transcript"]] if episode else [])
            for s in samples]
    return columns + (["rounds", "transcript"] if episode else []), rows


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A markdown table (TensorBoard's text plugin renders it), cells on one line each."""
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def finite(scalars: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in scalars.items() if math.isfinite(v)}


def tracker_env(name: str, run_dir: Path) -> dict[str, str]:
    """The environment a tracker package reads, so that it writes only under ``run_dir`` and sends nothing.

    wandb: the process-wide mode offline (else its own usage telemetry probes a server even for an offline run),
    no crash reports, its cache (wandb-core's logs) and data (a table's artifact staging) under <run>/wandb.
    MLflow: its file store allowed (MLflow 3 keeps it in maintenance mode), no usage telemetry (which writes an
    id under ~/.config and sends events). trackio: its folder, read once when trackio is first imported."""
    run_dir = run_dir.resolve()
    if name == "wandb":
        home = run_dir / "wandb"
        return {"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false", "WANDB_CACHE_DIR": str(home / "cache"),
                "WANDB_DATA_DIR": str(home / "data")}
    if name == "mlflow":
        return {"MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}
    if name == "trackio":
        return {"TRACKIO_DIR": str(run_dir / "trackio")}
    return {}


def set_env(values: dict[str, str]) -> dict[str, str | None]:
    """Sets each variable the user has not set; returns the values before, for ``restore_env``."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if before[k] is None})
    return before


def restore_env(before: dict[str, str | None]) -> None:
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class TensorBoard:
    """Event files in <run>/tensorboard (torch's SummaryWriter); samples as a markdown table under "samples"."""

    def __init__(self, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", markdown_table(["option", "value"], sorted(config.items())), 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.writer.add_text("samples", markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """An offline W&B run (mode="offline": no network) with its files in <run>/wandb; samples as a wandb.Table
    (files/media/table/*.table.json, each text whole). ``wandb sync <run>/wandb/offline-run-*`` uploads it
    where there is network."""

    def __init__(self, run_dir: Path, config: dict):
        self.env = set_env(tracker_env("wandb", run_dir))
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project="sat", name=run_dir.name, dir=str(run_dir), config=config, mode="offline")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.run.log({"samples": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()
        restore_env(self.env)


class Trackio:
    """A local trackio project "sat" in one SQLite file, <run>/trackio/sat.db (unless TRACKIO_DIR says otherwise),
    never a Space; samples as a trackio.Table, each text whole. ``trackio show --project sat`` with the same
    TRACKIO_DIR serves its dashboard. trackio fixes its folder when first imported, so one process reports to
    one run folder's trackio; a second one is refused rather than written into the first."""

    def __init__(self, run_dir: Path, config: dict):
        self.env = set_env(tracker_env("trackio", run_dir))
        import trackio
        from trackio.utils import TRACKIO_DIR

        wanted = os.environ["TRACKIO_DIR"]
        if Path(TRACKIO_DIR).resolve() != Path(wanted).resolve():
            restore_env(self.env)
            raise RuntimeError(f"--report-to trackio: this process's trackio writes to {TRACKIO_DIR} (fixed when "
                               f"trackio was first imported), not {wanted}; report one run folder per process")
        self.trackio = trackio
        self.run = trackio.init(project="sat", name=run_dir.name, config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.trackio.log(scalars, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.trackio.log({"samples": self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.trackio.finish()
        restore_env(self.env)


class MLflow:
    """An MLflow run (experiment "sat") in the file store <run>/mlruns, which needs no database and works with
    mlflow-skinny; samples as a JSON table per stage (artifacts/samples/stage_NNNN.json, each text whole).
    Reading it back needs MLFLOW_ALLOW_FILE_STORE=true too (MLflow 3 keeps that store in maintenance mode), so
    does ``mlflow ui --backend-store-uri <run>/mlruns`` (the full mlflow package) that shows it."""

    def __init__(self, run_dir: Path, config: dict):
        self.env = set_env(tracker_env("mlflow", run_dir))
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment("sat")
        self.run = mlflow.start_run(run_name=run_dir.name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})  # 500 characters: any MLflow takes that

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        table = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self.mlflow.log_table(data=table, artifact_file=f"samples/stage_{step:04d}.json")

    def close(self) -> None:
        self.mlflow.end_run()
        restore_env(self.env)


BACKENDS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio, "mlflow": MLflow}


class Trackers:
    """The run's trackers (none: every call does nothing): one ``log_stage`` per metrics row."""

    def __init__(self, names: tuple[str, ...], run_dir: str | Path, config: dict):
        check_report_to(names)
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.backends = [BACKENDS[name](run_dir, config) for name in names]

    def log_stage(self, row: dict, samples: list[dict]) -> None:
        """A stage's metrics row (its scalars, at step = the stage) and samples (records.stage_samples)."""
        step, scalars = int(row["stage"]), finite(flatten(row))
        columns, rows = sample_table(samples)
        for backend in self.backends:
            backend.log(step, scalars)
            if rows:
                backend.log_samples(step, columns, rows)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
