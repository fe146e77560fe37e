"""--upgrade-accept: how a replacement enters the team (harness/certified_acceptance.py, harness/upgrades.py;
paper Sec. 4.3 and 5, Eq. (7)).

certified: Stage-0 candidates and the raw swap ranked by a paired lower bound on a selection split, the pick
swapped in only with a paired lower bound > 0 on a second, disjoint split; neither split shares a problem with
the run's held-out rows."""
import json
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import harness.cli
import harness.run
import sat
from bounds import paired_change_bound
from harness import certified_acceptance
from harness.certified_acceptance import AcceptanceDraws, Candidate, acceptance_splits, certified_upgrade, certify
from harness.config import Config
from harness.loading import load_agent, load_saved_team, warm_start
from harness.math_grading import math_team_config
from harness.run_folder import latest_checkpoint, read_metrics
from harness.tasks import arithmetic_problems, load_task
from rollout import SamplingConfig
from scale.rollout_hf import HF
from team import Problem, Team

QUIET = dict(log=lambda *_: None)


def texts(rows: list[Problem]) -> set[str]:
    return {p.problem for p in rows}


# ---------------------------------------------------------------------------
# The splits
# ---------------------------------------------------------------------------
@given(st.lists(st.integers(0, 40), min_size=2, max_size=80), st.lists(st.integers(0, 40), max_size=20),
       st.integers(1, 300), st.integers(0, 5))
def test_splits_are_disjoint_from_each_other_and_from_the_heldout_rows(train_ids, held_ids, rows, seed):
    """Problems repeat in the training list (as the arithmetic task's do) and may also be asked held out."""
    train = [Problem(f"t{i}", f"{i}+1", str(i + 1)) for i in train_ids]
    heldout = [Problem(f"h{i}", f"{i}+1", str(i + 1)) for i in held_ids]
    left = texts(train) - texts(heldout)
    if len(left) < 2:
        with pytest.raises(ValueError, match="only .* remain"):
            acceptance_splits(train, heldout, seed, rows)
        return
    splits = acceptance_splits(train, heldout, seed, rows)
    sel, cert = texts(splits["selection"]), texts(splits["certification"])
    assert not sel & cert and not (sel | cert) & texts(heldout) and sel | cert <= texts(train)
    assert [len(splits[s]) for s in certified_acceptance.ACCEPTANCE_SPLITS] == [rows, rows]
    assert len(sel) == len(cert) == min(rows, len(left) // 2)  # as many problems as rows allow, the same in both
    assert splits == acceptance_splits(train, heldout, seed, rows)  # fixed by the seed


def test_splits_of_a_tiny_run_avoid_its_heldout_rows():
    cfg = Config(device="cpu").apply_preset()
    train, heldout, _ = load_task(cfg)
    splits = acceptance_splits(train, heldout, cfg.seed, cfg.upgrade_accept_rows)
    sel, cert = texts(splits["selection"]), texts(splits["certification"])
    assert len(sel) == len(cert) == len(texts(train)) // 2 and not sel & cert  # 327 distinct training pairs
    assert not (sel | cert) & texts(heldout)


# ---------------------------------------------------------------------------
# The rule, on paired rewards it is handed
# ---------------------------------------------------------------------------
def bernoulli_rewards(p: dict, rows: int, seed: int, common: bool = True):
    """A team with 'agent' k in the slot (None: the incumbent) scores row r as u_r < p[k]: one uniform per row
    and split for every team (``common`` random numbers), or one per row, split and team (row r's uniform is the
    r-th draw of the stream of its split, or of its split and team)."""
    def uniforms(split, agent):
        stream = random.Random(f"{seed} {split}" if common else f"{seed} {split} {agent}")
        return [stream.random() for _ in range(rows)]

    draws = {(split, k): uniforms(split, k) for split in certified_acceptance.ACCEPTANCE_SPLITS for k in p}
    return lambda agent, split: [float(u < p[agent]) for u in draws[split, agent]]


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), st.floats(0.0, 1.0), st.integers(0, 10 ** 6))
def test_certify_swaps_exactly_when_the_certification_bound_is_positive(means, incumbent, seed):
    names = [f"c{k}" for k in range(len(means))]
    rewards = bernoulli_rewards({None: incumbent, **dict(zip(names, means))}, 200, seed)
    chosen, record = certify([Candidate(n, lambda n=n: (n, None)) for n in names], rewards, 0.05, lambda *_: None)
    bounds = [c["selection"]["lower_bound"] for c in record["candidates"]]
    assert record["chosen"] == names[bounds.index(max(bounds))]  # the largest selection bound, the first on a tie
    cert = paired_change_bound(rewards(None, "certification"), rewards(record["chosen"], "certification"),
                               (0.0, 1.0), 0.05)
    assert record["certification"] == cert  # on the certification rows, not the selection rows
    assert record["swapped"] == (cert["lower_bound"] > 0)
    assert chosen == (record["chosen"] if record["swapped"] else None)


def test_certify_rarely_swaps_in_a_candidate_no_better_than_the_incumbent():
    """Six candidates exactly as good as the incumbent, each drawn independently of it (so the paired differences
    are not all 0): a swap would certify a gain that is not there, which a valid bound allows in at most
    delta_conf = 5% of the 200 trials (10; 20 leaves three binomial standard deviations). A rule that swapped
    on a positive mean would swap in about half of them."""
    swaps = 0
    for seed in range(200):
        rewards = bernoulli_rewards({None: 0.3, **{f"c{k}": 0.3 for k in range(6)}}, 100, seed, common=False)
        chosen, _ = certify([Candidate(f"c{k}", lambda k=k: (f"c{k}", None)) for k in range(6)], rewards, 0.05,
                            lambda *_: None)
        swaps += chosen is not None
    assert swaps <= 20  # measured 0


# ---------------------------------------------------------------------------
# The rule on real tiny agents
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_agents():
    """A tiny agent warm-started 200 steps (held-out accuracy about 0.15) and an untrained one (0)."""
    train = arithmetic_problems(512, seed=0)
    good = load_agent("tiny", seed=0)
    warm_start(Team([good], math_team_config()), train, 200, 0.5, seed=0)
    return train, good, load_agent("tiny", seed=1)


def one_agent_upgrade(incumbent, replacement, train, rows=512, max_passes=3):
    """``certified_upgrade`` of a one-agent team's slot, on splits of ``train`` drawn with ``sat.evaluate``."""
    cfg = Config(agents="tiny", device="cpu", batch_size=32, group_size=4, upgrade_accept="certified",
                 upgrade=["1=tiny"], stage0_max_passes=max_passes).apply_preset()
    sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    heldout = arithmetic_problems(64, seed=1, split="heldout")
    one = replace(cfg, eval_samples=1).core()
    draws = AcceptanceDraws(acceptance_splits(train, heldout, 0, rows), lambda team, r, label:
                            sat.evaluate(team, r, sampling, one, HF, label=label)["eval_rewards"])
    team = Team([incumbent], math_team_config())
    return team, certified_upgrade(team, 0, replacement, train[:8], cfg, sampling, draws, 1, lambda *_: None, HF)


@pytest.mark.slow  # over 10 s: a 200-step warm start, then Stage-0 candidates and 2 x 7 draws of 512 rows
def test_certified_keeps_the_incumbent_against_a_weaker_replacement_and_swaps_a_stronger_one(tiny_agents):
    train, good, untrained = tiny_agents
    _, (chosen, record) = one_agent_upgrade(good, untrained, train)
    assert chosen is None and not record["swapped"] and record["certification"]["lower_bound"] <= 0
    assert record["certification"]["mean_change"] < 0  # the untrained agent answers nothing right
    names = [c["candidate"] for c in record["candidates"]]
    assert names == [f"stage0 delta0={d:g}" for d in certified_acceptance.CERTIFIED_RADII] + ["raw"]
    assert all(("selection" in c) != ("error" in c) for c in record["candidates"])  # bounded, or Stage-0 failed
    assert record["splits"]["selection"]["rows"] == record["certification"]["n"] == 512
    _, (chosen, record) = one_agent_upgrade(untrained, good, train)
    assert record["swapped"] and record["certification"]["lower_bound"] > 0 and chosen is not None
    if record["chosen"] == "raw":
        assert chosen is good


@pytest.mark.slow  # over 10 s: the warm start of the fixture
def test_certified_across_vocabularies_has_the_raw_swap_alone(tiny_agents):
    train, good, _ = tiny_agents
    other = load_agent("tiny", seed=2)
    other.tokenizer.add_tokens(["<|extra|>"])
    other.model.resize_token_embeddings(len(other.tokenizer))
    team, (chosen, record) = one_agent_upgrade(good, other, train, rows=64)
    assert [c["candidate"] for c in record["candidates"]] == ["raw"]
    assert record["stage0_candidates"].startswith("none: Stage-0 is undefined across vocabularies")
    assert "vocabularies differ" in record["stage0_candidates"]
    assert team.swap(0, other, projected=False) is good  # a raw swap needs no shared vocabulary


# ---------------------------------------------------------------------------
# Through the run: the records, and stage0 as it was
# ---------------------------------------------------------------------------
def untimed(record):
    """A record without its wall-clock fields (seconds, tokens per second)."""
    if isinstance(record, dict):
        return {k: untimed(v) for k, v in record.items() if "seconds" not in k and not k.endswith("per_s")}
    return [untimed(v) for v in record] if isinstance(record, list) else record


@pytest.fixture(scope="module")
def base_run(one_stage_tiny_run):
    """conftest's 1-stage run (each upgrade below resumes it into an --out of its own)."""
    return one_stage_tiny_run


def upgrade_run(base, out, *options):
    argv = ["--resume", str(base / "checkpoints" / "stage_0001"), "--out", str(out), "--upgrade", "2=tiny-3L",
            "--stages", "2", "--upgrade-warmup-steps", "20", "--stage0-delta", "0.05", "--stage0-max-passes", "30"]
    return harness.run.run(harness.cli.parse_args(argv + list(options)), **QUIET)


@pytest.mark.slow  # over 10 s: three upgrades of a tiny run
def test_run_records_the_rule_and_stage0_stays_as_it_was(base_run, tmp_path):
    rows = upgrade_run(base_run, tmp_path / "cert", "--upgrade-accept", "certified", "--upgrade-accept-rows", "64",
                       "--stage0-max-passes", "5")
    event = json.loads((tmp_path / "cert" / "upgrades.json").read_text())[0]
    accept = event["accept"]
    assert accept["rule"] == "certified" and rows[-1]["upgrades"][0] == event
    assert {"chosen", "swapped", "certification", "candidates", "splits", "stage0_candidates", "kind"} <= set(accept)
    assert accept["swapped"] == (accept["certification"]["lower_bound"] > 0)
    assert event["heldout_change"]["n"] == 16  # the held-out rows, paired with the row the run resumed from
    if not accept["swapped"]:  # the same team under the same seeds
        assert event["heldout_change"]["nonzero"] == 0
    for c in accept["candidates"]:
        assert "error" in c or c["selection"]["n"] == 64
    saved = json.loads((tmp_path / "cert" / "config.json").read_text())
    assert saved["upgrade"] == [] and saved["upgrade_accept"] == "stage0"  # a later --resume upgrades nothing
    team = load_saved_team(latest_checkpoint(tmp_path / "cert") / "team")
    assert [a.spec.name for a in team.agents] == ["tiny", "tiny-3L" if accept["swapped"] else "tiny"]
    raw = upgrade_run(base_run, tmp_path / "raw", "--upgrade-accept", "raw")
    assert raw[-1]["upgrades"][0]["accept"] == {"rule": "raw", "swapped": True}
    assert "stage0" not in raw[-1]["upgrades"][0]
    default = upgrade_run(base_run, tmp_path / "default")
    stage0 = upgrade_run(base_run, tmp_path / "stage0", "--upgrade-accept", "stage0")
    assert set(stage0[-1]["upgrades"][0]) == {"slot", "from", "to", "at_stage", "seconds", "stage0", "before_stage0",
                                              "eval_accuracy_after_stage0"}  # the event the paper's rule always wrote
    assert untimed(default) == untimed(stage0)
    for a, b in zip(*(load_saved_team(latest_checkpoint(tmp_path / d) / "team").agents for d in ("default", "stage0"))):
        assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    assert len(read_metrics(tmp_path / "stage0")) == 3
