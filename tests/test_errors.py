"""Every row of docs/errors.md, driven as written: bad inputs and faults, each
answered by one line on stderr and a non-zero exit, none by a traceback.

The table's command column is run in-process (harness.cli.main / harness.evaluation.main /
scale.memory.main), so validation errors cost milliseconds; the line column is the
whole last line of stderr, with "…" standing for any text and the placeholders
below replaced by real paths:

    RUN    a copy of a finished tiny run (2 stages, 2 agents; checkpoints stage_0001 and stage_0002)
    NEW    a folder that does not exist yet
    EMPTY  an empty JSONL file
    NOCHAT a local tiny model whose tokenizer has no chat template
    EVAL   an evaluation folder written by the setup step
    DATA   the repository's data/ folder

The setup column runs before the command: `truncate FILE`, `garble FILE`
(bytes in the middle overwritten, size kept), `delete PATH`, `write FILE TEXT`,
`eval ARGS` (an eval_aime.py run that must succeed), or `plant FILE` (a pickled
callable added to a state.pt, which would create FILE.ran if it ran; the stage
folder's checksums.json rewritten to match). No row's command may leave a .ran file."""
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

import harness.cli
import harness.run
from harness import evaluation, run_folder
from harness.config import Config
from harness.loading import load_agent
from scale import memory

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "errors.md"
ROW = re.compile(r"^\| (\d+) \| (.*?) \| `(.*?)` \| (.*?) \| (.*) \|$")


def table_rows() -> list[tuple]:
    rows = []
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            number, _what, command, setup, expected = m.groups()
            rows.append(pytest.param(command, setup.strip("` "), expected.strip().strip("`"), id=f"row{number}"))
    return rows


ROWS = table_rows()


def test_table_has_at_least_30_rows_numbered_in_order():
    assert len(ROWS) >= 30
    assert [p.id for p in ROWS] == [f"row{k}" for k in range(1, len(ROWS) + 1)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    cfg = Config(agents="tiny x2", stages=2, batch_size=8, group_size=4, epochs=1, minibatch_size=8, warmup_steps=5,
                 eval_size=8, out=str(root / "run"), device="cpu").apply_preset()
    harness.run.run(cfg, log=lambda *_: None)
    nochat = load_agent("tiny", seed=0)
    nochat.tokenizer.chat_template = None
    nochat.model.save_pretrained(root / "nochat")
    nochat.tokenizer.save_pretrained(root / "nochat")
    for f in (root / "nochat").glob("chat_template*"):
        f.unlink()
    config = root / "nochat" / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    return root


def run_tool(command: str, capsys) -> tuple[int, str]:
    tool, *argv = shlex.split(command.replace("python -m scale.memory", "scale.memory"))
    mains = {"sat.py": harness.cli.main, "eval_aime.py": evaluation.main, "scale.memory": memory.main}
    try:
        rc = mains[tool](argv)
    except SystemExit as exit_info:  # argparse and memory.py exit themselves
        rc = exit_info.code
    return rc, capsys.readouterr().err


class Planted:
    """Unpickled by a full unpickler, it would call open(path, "w")."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def plant(path: Path) -> None:
    """A pickled callable added to the state.pt at ``path``, and its stage folder's checksums rewritten to
    match: an intact file that would run code if it were unpickled in full."""
    state = torch.load(path, weights_only=True)
    torch.save({**state, "planted": Planted(path.with_name(path.name + ".ran"))}, path)
    (path.parent / run_folder.CHECKSUMS).write_text(json.dumps(run_folder.folder_digests(path.parent)))


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # garble: same size, different bytes
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 64]) + data[mid + 64:])


@pytest.mark.parametrize("command,setup,expected", ROWS)
def test_row(command, setup, expected, finished_run, tmp_path, monkeypatch, capsys):
    if "vLLM is not installed" in expected and __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    if "--device cuda" in command and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    monkeypatch.chdir(tmp_path)  # a default --out (runs/sat) lands in the test's folder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub is never reached from a test
    shutil.copytree(finished_run / "run", tmp_path / "run")
    (tmp_path / "empty.jsonl").write_text("")
    places = {"RUN": tmp_path / "run", "NEW": tmp_path / "new", "EMPTY": tmp_path / "empty.jsonl",
              "NOCHAT": finished_run / "nochat", "EVAL": tmp_path / "eval", "DATA": REPO / "data"}

    def fill(text):
        return re.sub(r"\b(RUN|NEW|EMPTY|NOCHAT|EVAL|DATA)\b", lambda m: str(places[m.group(1)]), text)

    if setup:
        verb, _, rest = setup.partition(" ")
        if verb in ("truncate", "garble"):
            damage(Path(fill(rest)), verb)
        elif verb == "delete":
            target = Path(fill(rest))
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        elif verb == "write":
            name, _, text = rest.partition(" ")
            Path(fill(name)).write_text(text)
        elif verb == "eval":
            assert run_tool(fill("eval_aime.py " + rest), capsys)[0] == 0
        elif verb == "plant":
            plant(Path(fill(rest)))
        else:
            raise AssertionError(f"unknown setup verb {verb!r}")
    before = snapshot(tmp_path / "run")
    rc, err = run_tool(fill(command), capsys)
    lines = err.strip().splitlines()
    assert rc != 0 and lines, err
    assert "Traceback" not in err
    pattern = ".*".join(re.escape(part) for part in fill(expected).split("…"))
    assert re.fullmatch(pattern, lines[-1]), f"\n  got: {lines[-1]}\n want: {fill(expected)}"
    if not command.startswith("python -m scale.memory") and "usage:" not in err:
        assert len(lines) == 1, err  # the tool's own errors are one line (argparse adds its usage line)
    if not setup:
        assert snapshot(tmp_path / "run") == before  # a refused command leaves the run folder as it was
    assert not list(tmp_path.rglob("*.ran"))  # nothing a checkpoint carried ran


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
