"""What an evaluation (``eval_aime.py``) writes in ``--out``, and the report it prints from it.

An evaluation folder holds

    run.json            the setting that decides the samples (``harness.eval_setting.eval_identity``)
    predictions.jsonl   one row per benchmark, problem, sample and who (each agent, the team)
    rounds.jsonl        an environment's rollout calls, round by round, with their wall time split
    summary.json        the metrics per benchmark and who, computed from predictions.jsonl alone (and an
                        environment's rounds' wall time from rounds.jsonl)

predictions.jsonl is append-only and crash-safe: rows are written whole, newline-terminated and forced to disk
after every chunk, a torn last line is cut off when the file is read, and a repeated row keeps its first copy.
run.json is written once; a rerun with a different setting is refused. summary.json is replaced atomically.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TRUNCATION_WARNING = 0.05  # warn when more than this share of an agent's responses hit --max-new-tokens


def row_key(row: dict) -> tuple:
    """What names a row of predictions.jsonl: (benchmark, problem id, sample, who)."""
    return (row["bench"], row["problem_id"], row["sample"], row["who"])


# -- predictions.jsonl: append-only, crash-safe ----------------------------------------------------------
def whole_lines(path: Path):
    """(line number, line) of each whole line of ``path``, in order. Rows are written whole and newline-terminated,
    so a last line without its newline was torn by a crash: once every whole line is read, it is cut off the file
    and the next append starts a line of its own."""
    good_end = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break
            good_end += len(line)
            yield lineno, line
    if good_end < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_end)


def read_predictions(path: Path) -> list[dict]:
    """The rows written so far, line by line, without their text (a thinking run writes gigabytes). A torn
    last line (a crash) is cut off the file; a repeated key keeps its first row."""
    if not path.exists():
        return []
    rows, seen = [], set()
    for lineno, line in whole_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # cannot come from this program's appends; regenerate it rather than stop
            print(f"eval_aime.py: warning: {path}:{lineno} is not valid JSON; it will be regenerated", file=sys.stderr)
            continue
        if row_key(row) not in seen:
            seen.add(row_key(row))
            rows.append({k: v for k, v in row.items() if k != "text"})
    return rows


ROUNDS_FILE = "rounds.jsonl"  # an environment's rollout calls: each round's episodes and its wall time split


def read_rounds(path: Path) -> list[dict]:
    """rounds.jsonl's rows, in file order; a torn last line is cut off the file, as predictions.jsonl's is."""
    if not path.exists():
        return []
    return [json.loads(line) for _, line in whole_lines(path) if line.strip()]


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append rows and force them to disk before the next chunk starts."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


# -- run.json and summary.json ---------------------------------------------------------------------------
def check_identity(out: Path, identity: dict) -> None:
    """Write run.json on the first run; refuse to mix predictions of a different setting (every key of
    either side is compared, so a checkpoint team and a named team never share an --out)."""
    path = out / "run.json"
    if path.exists():
        saved = json.loads(path.read_text())
        diff = [describe_difference(k, saved.get(k), identity.get(k))
                for k in sorted(set(saved) | set(identity)) if saved.get(k) != identity.get(k)]
        if diff:
            pred = out / "predictions.jsonl"
            holds = ("holds predictions of" if pred.exists() and pred.stat().st_size
                     else "was started (no predictions yet) with")
            raise ValueError(f"--out {out} {holds} a different setting ({'; '.join(diff)}); use a new --out")
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(identity, indent=2))
    os.replace(tmp, path)


def describe_difference(key: str, there, now) -> str:
    """One setting that differs, with both values when they are short."""
    a, b = repr(there), repr(now)
    return f"{key}: {a} there vs {b} now" if len(a) + len(b) <= 80 else f"{key} differs"


def write_summary(out: Path, summary: dict) -> None:
    """summary.json, through a temporary file and a rename: a reader never sees half of it."""
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")


# -- The report ------------------------------------------------------------------------------------------
def markdown_table(summary: dict, k: int) -> str:
    """One row per benchmark and who: each metric in percent with its interval, response lengths, truncation."""
    names = [f"avg@{k}", "pass@1", f"pass@{k}", f"maj@{k}"]
    head = ["bench", "who", *[f"{n} % [95% CI]" for n in names], "tokens mean / median / max", "truncated"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bench, b in summary.items():
        for who, m in b["metrics"].items():
            cells = [f"{100 * m[n]['value']:.1f} [{100 * m[n]['ci95'][0]:.1f}, {100 * m[n]['ci95'][1]:.1f}]"
                     for n in names]
            ln = b["lengths"][who]
            lengths = f"{ln['mean_tokens']:.0f} / {ln['median_tokens']:.0f} / {ln['max_tokens']}"
            lines.append("| " + " | ".join([bench, who, *cells, lengths, f"{100 * ln['truncated']:.1f}%"]) + " |")
        if "rounds" in b:  # an environment's episodes: avg@K is the mean reward, pass@K the share at its maximum
            if "success" in b:  # the headline: episodes solved, the team's pass@1
                lo, hi = b["success"]["ci95"]
                lines.append(f"| {bench} | **success** (episodes solved) | {100 * b['success']['value']:.1f} "
                             f"[{100 * lo:.1f}, {100 * hi:.1f}] |")
            lines.append(f"| {bench} | rounds used | mean {b['rounds']['mean']:.2f}, max {b['rounds']['max']} |")
    return "\n".join(lines)


def truncation_warnings(summary: dict, max_new_tokens: int) -> list[str]:
    """A truncated thinking model scores as wrong without any error: say so loudly."""
    out = []
    for bench, b in summary.items():
        for who, ln in b["lengths"].items():
            if who != "team" and ln["truncated"] > TRUNCATION_WARNING:
                out.append(f"warning: {bench} {who}: {100 * ln['truncated']:.1f}% of responses hit --max-new-tokens "
                           f"{max_new_tokens} (no end of sequence); their answers are likely missing, so accuracy is "
                           f"underestimated; raise --max-new-tokens (thinking models need up to 32768)")
    return out
