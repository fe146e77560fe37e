"""What makes a stage fast must not change what it computes: encoded prompts,
the reference pi_j,cur's outputs, the rollout's behaviour forward reused as
pi_j,cur's, and in-loop KL measurements reused by the line search, each
checked bit for bit against the computation without it; and the thread policy."""
import copy
import os
import time
from pathlib import Path

import pytest
import torch

import logprobs
import sat
import update
from logprobs import adopt_scoring, measure_kl
from rollout import SamplingConfig
from tasks import arithmetic_problems
from team import Agent, Team, TeamConfig

from test_sat import perturb, small_config, strip_timing, tiny_team_and_batch


@pytest.fixture(scope="module")
def team_and_batch():
    return tiny_team_and_batch("independent")


def test_encoded_prompts_are_cached_and_equal_fresh_tokenisation():
    agent = Agent.load("tiny")
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    first = agent.encode_prompt(messages)
    fresh = agent.tokenizer(agent.render_prompt(messages), add_special_tokens=False)["input_ids"]
    assert first == fresh and len(agent._prompt_cache) == 1
    first.append(-1)  # a caller extending its copy must not change the cache
    assert agent.encode_prompt(messages) == fresh
    assert agent.encode_prompt([{"role": "user", "content": "What is 12 + 31?"}]) != fresh  # another prompt, another entry
    assert agent.encode_text("42") == agent.tokenizer("42", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kind", ["logits", "hidden", "none"])  # what the memory budget lets the cache keep
def test_cached_reference_gives_the_same_kl_bit_for_bit(team_and_batch, monkeypatch, kind):
    team, batch = team_and_batch
    monkeypatch.setattr(logprobs, "cache_kind", lambda model, mask: kind)
    turn = batch.turns[0]
    reference = copy.deepcopy(team.agents[0].model)
    agent = Agent(team.agents[0].spec, copy.deepcopy(team.agents[0].model), team.agents[0].tokenizer)
    for seed in range(3):  # the agent moves between measurements; the reference does not
        perturb(agent.model, 0.02, seed=seed)
        cached = measure_kl(agent, reference, turn, 1.0, 64, return_log_rho=True, frozen_reference=True)
        fresh = measure_kl(agent, copy.deepcopy(reference), turn, 1.0, 64, return_log_rho=True)
        for a, b in zip(cached, fresh):
            assert torch.equal(a, b)
        assert cached[0].max() > 0  # the agent did move
    kinds = {key[-1] for key in logprobs._REFERENCE_CACHE.get(reference, {})}
    assert kinds == (set() if kind == "none" else {kind})


def test_cache_kind_follows_the_memory_budget(team_and_batch, monkeypatch):
    team, batch = team_and_batch
    mask = batch.turns[0].response_mask
    model = team.agents[0].model
    positions, vocab, hidden = int(mask.sum()), model.config.vocab_size, model.config.hidden_size
    monkeypatch.setattr(logprobs, "REFERENCE_CACHE_BYTES", positions * vocab * 4)
    assert logprobs.cache_kind(model, mask) == "logits"
    monkeypatch.setattr(logprobs, "REFERENCE_CACHE_BYTES", positions * min(vocab, hidden) * 4 - 1)
    assert logprobs.cache_kind(model, mask) == "none"


def test_rollout_scoring_is_adopted_only_while_the_weights_are_unchanged(team_and_batch):
    team, batch = team_and_batch
    turn, model = batch.turns[1], team.agents[1].model
    assert turn.scoring is not None and turn.scoring["kind"] == "logits"
    reference = copy.deepcopy(model)
    adopt_scoring(reference, model, turn)
    adopted = dict(logprobs._REFERENCE_CACHE[reference])
    agent = Agent(team.agents[1].spec, copy.deepcopy(model), team.agents[1].tokenizer)
    perturb(agent.model, 0.02)
    budget = SamplingConfig().token_budget  # the rollout's chunks of rows (sat.py: --token-budget for both)
    with_rollout = measure_kl(agent, reference, turn, 1.0, budget, return_log_rho=True, frozen_reference=True)
    assert logprobs._REFERENCE_CACHE[reference].keys() == adopted.keys()  # no forward of the reference was needed
    fresh = measure_kl(agent, copy.deepcopy(model), turn, 1.0, budget, return_log_rho=True)
    for a, b in zip(with_rollout, fresh):
        assert torch.equal(a, b)
    moved = copy.deepcopy(model)
    perturb(model, 0.0)  # an in-place change (even by zero) means the weights may differ: not adopted
    adopt_scoring(moved, model, turn)
    assert not logprobs._REFERENCE_CACHE.get(moved)


@pytest.mark.parametrize("overrides", [dict(protocol="independent", epochs=3, kl_check_every=1, delta=0.05),
                                       dict(protocol="chain", epochs=2), dict(update="joint", epochs=2)])
def test_runs_with_and_without_the_caches_are_identical(tmp_path, monkeypatch, overrides):
    fast = sat.run(small_config(tmp_path / "fast", **overrides), log=lambda *_: None)
    with monkeypatch.context() as m:  # every measurement recomputed, nothing reused
        m.setattr(logprobs, "REFERENCE_CACHE_BYTES", -1)
        m.setattr(update, "dropout_free", lambda model: False)
        slow = sat.run(small_config(tmp_path / "slow", **overrides), log=lambda *_: None)
    assert strip_timing(fast) == strip_timing(slow)
    if "delta" in overrides:  # a small radius: the in-loop stop and the line search both ran
        assert any(a["backtracks"] and a["early_stopped"] for r in fast[1:] for a in r["agents"])


def test_threads_default_to_one_and_follow_the_option(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert sat.configure_threads(None, "cpu") == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert sat.configure_threads(None, "cpu") == 2 and torch.get_num_threads() == 2
        assert sat.configure_threads(1, "cpu") == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cli_rejects_zero_threads(capsys):
    assert sat.main(["--threads", "0", "--stages", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def serial_warm_start(team, problems, steps, p_wrong, seed, lr=1e-3, batch=8):
    """The warm start as one loop per agent, each step's batch drawn right before
    it (the code before batches were drawn ahead and agents trained apart)."""
    import random
    from advantage import masked_mean
    from logprobs import left_pad, response_hidden_states, right_pad, token_logprobs_from_hidden
    from tasks import noisy_label
    rng = random.Random(seed)
    for k, agent in enumerate(team.agents):
        opt, tok = agent.start_training(lr), agent.tokenizer
        for _ in range(steps):
            items = [rng.choice(problems) for _ in range(batch)]
            contexts = [team.prompt_ids(k, p, [noisy_label(p.answer, rng, p_wrong) for _ in range(k)]) for p in items]
            targets = [agent.encode_text(noisy_label(p.answer, rng, p_wrong)) + [tok.eos_token_id] for p in items]
            ctx, cmask = left_pad(contexts, tok.pad_token_id)
            resp, rmask = right_pad(targets, tok.pad_token_id)
            logp = token_logprobs_from_hidden(agent.model, response_hidden_states(agent.model, ctx, cmask, resp, rmask), resp, 1.0)
            opt.zero_grad(set_to_none=True)
            (-masked_mean(logp, rmask)).backward()
            opt.step()
        agent.freeze()


@pytest.mark.parametrize("protocol", ["independent", "chain"])
def test_warm_start_on_two_cores_equals_one_agent_after_the_other(protocol):
    from team import warm_start
    problems = arithmetic_problems(40, seed=1)
    teams = [Team([Agent.load("tiny", seed=k) for k in range(3)], TeamConfig(protocol=protocol)) for _ in range(3)]
    serial_warm_start(teams[0], problems, 4, 0.5, seed=3)
    warm_start(teams[1], problems, 4, 0.5, seed=3, batch=8, parallel=False)
    warm_start(teams[2], problems, 4, 0.5, seed=3, batch=8, parallel=True)  # agents 2 and 3 each in a forked child
    start = Agent.load("tiny", seed=1).model.state_dict()
    for k in range(3):
        ref = teams[0].agents[k].model.state_dict()
        assert any(not torch.equal(ref[n], start[n]) for n in ref) or k != 1  # agent 2 did train
        for t in teams[1:]:
            got = t.agents[k].model.state_dict()
            assert all(torch.equal(ref[n], got[n]) for n in ref)
            assert not t.agents[k].model.training and not any(p.requires_grad for p in t.agents[k].model.parameters())


def test_fork_map_keeps_job_order_and_reports_a_failing_child():
    from parallel import fork_map
    assert fork_map(lambda x: (x, torch.full((3,), float(x))).__repr__(), list(range(5)), parallel=True) == \
        [(x, torch.full((3,), float(x))).__repr__() for x in range(5)]
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fork_map(lambda x: 1 / (x - 1), [0, 1, 2], parallel=True)  # job 1 runs in the child


def warm_team(protocol: str, steps: int) -> Team:
    """Two tiny agents warm-started for ``steps`` steps (``team.warm_start``):
    untrained ones score 0, so a stage's update has no signal and never nears delta."""
    from team import warm_start
    team = Team([Agent.load("tiny", seed=k) for k in range(2)], TeamConfig(protocol=protocol))
    warm_start(team, arithmetic_problems(64, seed=9), steps, 0.5, seed=3, batch=8, parallel=False)
    return team


@pytest.mark.parametrize("protocol", ["independent", "chain"])
def test_speculative_line_search_on_the_spare_core_changes_nothing(monkeypatch, protocol):
    """The first backtrack (fraction 1/2) measured in a forked child during the
    in-loop check gives the stage record of the serial stage, and the parent
    then makes fewer KL measurements of its own (the child's answer was used)."""
    import random

    import parallel
    from trust_region import QuantileController
    cfg = small_config(Path("unused"), protocol=protocol, epochs=3, kl_check_every=1, delta=0.01)
    sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, token_budget=cfg.token_budget)
    problems = arithmetic_problems(cfg.batch_size // cfg.group_size, seed=2)
    team = warm_team(protocol, 80)
    records, calls = {}, {}
    for fork in (True, False):
        counted = []
        with monkeypatch.context() as m:
            m.setattr(parallel, "idle_core", lambda fork=fork: fork)
            m.setattr(sat, "measure_kl", lambda *a, **kw: counted.append(1) or measure_kl(*a, **kw))
            torch.manual_seed(0)
            controllers = {k: QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta) for k in range(2)}
            records[fork] = sat.sat_stage(copy.deepcopy(team), problems, cfg, sampling, controllers, {}, random.Random(0))
        calls[fork] = len(counted)
    assert strip_timing([records[True]]) == strip_timing([records[False]])
    halves = sum(1 for a in records[False]["agents"] if a["early_stopped"] and a["backtracks"] >= 1)
    assert halves > 0 and calls[True] == calls[False] - halves  # finish_update's parent-side measurements


def test_fork_call_returns_the_value_or_is_cancelled():
    from parallel import fork_call
    pending = fork_call(lambda: torch.arange(5.0) * 2, parallel=True)
    assert torch.equal(pending.result(), torch.arange(5.0) * 2)
    slow = fork_call(lambda: sum(range(10 ** 9)), parallel=True)
    started = time.perf_counter()
    slow.cancel()  # killed, not waited for: reaped, and its pipe closed
    assert time.perf_counter() - started < 5
    with pytest.raises(ChildProcessError):
        os.waitpid(slow.pid, os.WNOHANG)
    with pytest.raises(OSError):
        os.fstat(slow.read_fd)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fork_call(lambda: 1 / 0, parallel=True).result()
    assert fork_call(lambda: 1, parallel=False) is None


@pytest.mark.parametrize("protocol", ["independent", "chain"])
def test_rollout_scoring_in_a_child_equals_the_serial_rollout(monkeypatch, protocol):
    """Agent k's behaviour log-probs computed in a forked child while agent k+1
    generates: the same batch (tokens, log-probs, kept outputs) bit for bit."""
    import parallel
    from rollout import rollout
    team = Team([Agent.load("tiny", seed=k) for k in range(3)], TeamConfig(protocol=protocol))
    batches, forks = [], []
    fork_call = parallel.fork_call
    for idle in (False, True):
        monkeypatch.setattr(parallel, "idle_core", lambda idle=idle: idle)
        monkeypatch.setattr(parallel, "fork_call", lambda fn, parallel=None: forks.append(1) or fork_call(fn, parallel))
        torch.manual_seed(1)
        batches.append(rollout(team, arithmetic_problems(5, seed=2), 3, SamplingConfig(temperature=1.0, max_new_tokens=5)))
    assert len(forks) == 2  # agents 1 and 2 scored in children, agent 3 here
    for a, b in zip(batches[0].turns, batches[1].turns):
        for name in ("context_ids", "response_ids", "response_mask", "behaviour_logprobs"):
            assert torch.equal(getattr(a, name), getattr(b, name))
        assert a.answers == b.answers and a.behaviour_logprobs.abs().sum() > 0
        assert a.scoring["version"] == b.scoring["version"] and a.scoring["outputs"].keys() == b.scoring["outputs"].keys()
        for key, (lp, pieces) in a.scoring["outputs"].items():
            assert torch.equal(lp, b.scoring["outputs"][key][0])
            assert all(torch.equal(x, y) for x, y in zip(pieces, b.scoring["outputs"][key][1]))
    assert torch.equal(batches[0].rewards, batches[1].rewards)


def test_fork_map_each_keeps_job_order_and_reports_a_failing_child():
    from parallel import fork_map_each
    pids = fork_map_each(lambda x: os.getpid(), [0, 1, 2], parallel=True)
    assert pids[0] == os.getpid() and len(set(pids)) == 3  # one process per job
    assert fork_map_each(lambda x: (x, torch.full((3,), float(x))).__repr__(), list(range(4)), parallel=True) == \
        [(x, torch.full((3,), float(x))).__repr__() for x in range(4)]
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fork_map_each(lambda x: 1 / (x - 2), [0, 1, 2, 3], parallel=True)  # job 2 runs in a child


EXIT_SCRIPT = """
import atexit, ctypes, os, sys, threading, time
sys.path.insert(0, {repo!r})
import parallel

class Teardown:  # a module global: only the interpreter's teardown deletes it
    def __del__(self, write=os.write):  # (the module's globals may be gone by then)
        write(2, b"torn down")

kept = Teardown()
atexit.register(lambda: open({marker!r}, "w").write("atexit ran"))
case = {case!r}
if case == "thread":  # a non-daemon thread still writing: the exit must wait for it
    threading.Thread(target=lambda: (time.sleep(0.3), open({marker!r} + ".late", "w").write("done"))).start()
if case == "background":  # a stage still closing in a forked child: its files must land
    parallel.background_call(lambda: (time.sleep(0.3), open({marker!r} + ".late", "w").write("done")), "closing", True)
print("python line", end="")  # buffered, no newline
ctypes.CDLL(None).printf(b"C line")  # C's stdio buffer (stdout is a pipe)
if case == "lost output":
    class Full:
        def write(self, text):
            return len(text)
        def flush(self):
            raise OSError(28, "No space left on device")
    sys.stdout.flush()
    sys.stdout = Full()
parallel.exit_process(0 if case == "lost output" else 3)
"""


@pytest.mark.parametrize("case", ["plain", "thread", "background", "lost output"])
def test_exit_process_skips_only_the_teardown(tmp_path, case):
    """parallel.exit_process: the exit code, both stdio buffers and the atexit
    handlers as sys.exit, and a background child (records.close_stage)
    finished first; the teardown (a global's __del__) skipped, unless a
    non-daemon thread is still running: then sys.exit, which waits for it.
    Output that cannot be flushed: status 120, as Python's own exit."""
    import subprocess
    import sys
    marker = str(tmp_path / "marker")
    script = EXIT_SCRIPT.format(repo=str(Path(__file__).resolve().parents[1]), marker=marker, case=case)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (which leaves C's stdout unbuffered too)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == (120 if case == "lost output" else 3), done.stderr
    assert "python line" in done.stdout and "C line" in done.stdout
    assert Path(marker).read_text() == "atexit ran"
    assert ("torn down" in done.stderr) == (case == "thread")  # the fast path never frees its objects
    assert Path(marker + ".late").exists() == (case in ("thread", "background"))


def test_stage_closing_in_a_child_equals_serial_and_evaluation_leaves_training_alone(tmp_path, monkeypatch):
    """records.close_stage (held-out evaluation, metrics row, checkpoint) in a forked child gives the
    serial run's metrics; the evaluation draws from its own seeded stream, so evaluating on other
    problems changes no training figure."""
    import parallel
    import records
    small = dict(stages=2, warmup_steps=5, batch_size=16, minibatch_size=8, eval_size=8)
    monkeypatch.setattr(parallel, "spare_core", lambda: True)  # the end of each stage in a child, whatever the machine
    forked = sat.run(small_config(tmp_path / "forked", **small), log=lambda *_: None)
    monkeypatch.setattr(parallel, "spare_core", lambda: False)
    serial = sat.run(small_config(tmp_path / "serial", **small), log=lambda *_: None)
    other_eval = sat.run(small_config(tmp_path / "other", **{**small, "eval_size": 12}), log=lambda *_: None)
    assert strip_timing(forked) == strip_timing(serial)  # and the same seed gave the same run twice
    assert strip_timing(records.read_metrics(tmp_path / "forked" / "run")) == strip_timing(forked)
    assert records.latest_checkpoint(tmp_path / "forked" / "run").name == "stage_0002"
    training = lambda recs: [{k: v for k, v in r.items() if not k.startswith("eval") and k not in  # noqa: E731
                              ("measured_change", "violation")} for r in strip_timing(recs)[1:]]
    assert training(other_eval) == training(serial)


@pytest.mark.parametrize("protocol,every,delta,warm,seed", [
    ("independent", 1, 0.1, 120, 3),  # agent 1: step 1 inside, step 2 crosses, seen at step 3
    ("chain", 4, 0.01, 80, 2)])  # agent 1 crosses at step 4 of 6: seen when the epochs end
def test_speculative_in_loop_checks_change_nothing(monkeypatch, protocol, every, delta, warm, seed):
    """An in-loop check measured in a forked child while the parent trains on
    (update._speculate) leaves what the serial check leaves: the same records,
    weights, AdamW moments and torch RNG state, the steps trained past a
    crossing undone; the parent then makes fewer KL measurements itself."""
    import random

    import parallel
    from trust_region import QuantileController
    cfg = small_config(Path("unused"), protocol=protocol, epochs=3, kl_check_every=every, delta=delta,
                       keep_optimizer_state=True)
    sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, token_budget=cfg.token_budget)
    problems = arithmetic_problems(cfg.batch_size // cfg.group_size, seed=seed)
    team = warm_team(protocol, warm)
    out = {}
    for fork in (True, False):
        counted, forks = [], []
        with monkeypatch.context() as m:
            m.setattr(parallel, "idle_core", lambda fork=fork: fork)
            m.setattr(update, "worth_speculating", lambda *a: True)  # every check that can be speculated is
            m.setattr(update, "_speculate", lambda *a, f=update._speculate: forks.append(1) or f(*a))
            m.setattr(update, "measure_kl", lambda *a, **kw: counted.append(1) or measure_kl(*a, **kw))
            torch.manual_seed(0)
            controllers = {k: QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta) for k in range(2)}
            trained = copy.deepcopy(team)
            rec = sat.sat_stage(trained, problems, cfg, sampling, controllers, {}, random.Random(0))
        out[fork] = dict(rec=strip_timing([rec]), team=trained, rng=torch.get_rng_state(), calls=len(counted), forks=len(forks))
    fast, slow = out[True], out[False]
    assert fast["rec"] == slow["rec"] and torch.equal(fast["rng"], slow["rng"])
    for a, b in zip(fast["team"].agents, slow["team"].agents):
        assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
        sa, sb = a.saved_optimizer_state["state"], b.saved_optimizer_state["state"]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k])
    first = slow["rec"][0]["agents"][0]
    assert first["early_stopped"] and first["inner_steps"] == every * (1 if every == 4 else 2)  # the case it is meant to be
    assert slow["forks"] == 0 and fast["forks"] > 0 and fast["calls"] == slow["calls"] - fast["forks"]


def test_padding_matches_a_row_by_row_loop():
    """logprobs.left_pad / right_pad (one masked write) against the per-row loop they replaced."""
    import random
    from logprobs import left_pad, right_pad
    rng = random.Random(0)
    for _ in range(200):
        seqs = [[rng.randrange(50000) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(1, 6))]
        width = max(len(s) for s in seqs)
        for pad, right in ((left_pad, False), (right_pad, True)):
            w = max(1, width) if right else width
            ids, mask = torch.full((len(seqs), w), 7), torch.zeros((len(seqs), w), dtype=torch.long)
            for i, s in enumerate(seqs):
                cols = slice(0, len(s)) if right else slice(w - len(s), w)
                if s:
                    ids[i, cols], mask[i, cols] = torch.tensor(s), 1
            got = pad(seqs, 7)
            assert torch.equal(got[0], ids) and torch.equal(got[1], mask) and got[0].dtype == got[1].dtype == torch.long


def test_a_failing_speculated_check_raises_and_leaves_no_child(monkeypatch):
    import random

    import parallel
    from trust_region import QuantileController
    cfg = small_config(Path("unused"), epochs=2, kl_check_every=1)
    sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, token_budget=cfg.token_budget)
    team = Team([Agent.load("tiny", seed=k) for k in range(2)], TeamConfig(protocol=cfg.protocol))

    def fails_in_child(*a, **kw):
        if parallel.IN_CHILD:
            raise ZeroDivisionError("in the child")
        return measure_kl(*a, **kw)
    monkeypatch.setattr(parallel, "idle_core", lambda: True)
    monkeypatch.setattr(update, "worth_speculating", lambda *a: True)
    monkeypatch.setattr(update, "measure_kl", fails_in_child)
    children, fork_call = [], parallel.fork_call
    monkeypatch.setattr(parallel, "fork_call", lambda *a, **kw: (lambda p: children.append(p) or p)(fork_call(*a, **kw)))
    controllers = {k: QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta) for k in range(2)}
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        sat.sat_stage(team, arithmetic_problems(8, seed=2), cfg, sampling, controllers, {}, random.Random(0))
    assert children and all(p is not None for p in children)
    for p in children:  # every child this stage forked was reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(p.pid, os.WNOHANG)
