"""One SAT stage, phase by phase, against its compute floor.

Times one stage of Algorithm 1 (paper, Section 5: rollout, then per agent the
Eq. (5) update inside its trust region) as ``sat.py`` runs it, then the
held-out evaluation and the checkpoint ``sat.run`` adds to every stage, and
splits the time into phases (by timing the functions that do each phase):

    rollout        ``rollout.generate``: one batched generate per agent turn
    behaviour lp   ``rollout.batched_response_logprobs``: the behaviour log-probs
    update         ``update._gradient_step``: forward + backward + AdamW step
    KL checks      ``measure_kl``: the exact per-state KL (in-loop and line search)
    other          the rest of the stage (advantages, copies of pi_j,cur, ...)
    evaluation     ``sat.evaluate`` on the held-out problems
    checkpoint     ``records.save_checkpoint`` (timed here in the main process; ``sat.run`` writes
                   it in a forked child on the second core while the next stage runs)

Tokens/s count response tokens (the rows' generated tokens) that the phase
processes. The compute floor is measured in the same process on the same
shapes: per agent turn one bare ``model.generate`` over the stage's contexts,
plus, per agent, as many forward + backward + AdamW steps on minibatches of
the same rows as the stage took. stage/floor is the stage (without
evaluation and checkpoint) over that floor.

    python bench/stage.py                          # the tiny default stage
    python bench/stage.py --workload matched       # 16 prompts x G=4, 32 new tokens, one checkpoint x3
    python bench/stage.py --src /path/to/other/checkout   # the same bench on another version of the code

Timings depend on the machine's load: report ``uptime`` with them.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="tiny", choices=["tiny", "matched"])
ap.add_argument("--warmup-steps", type=int, default=100, help="warm start before the stage (not timed)")
ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: what sat.py picks)")
ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1]), help="the checkout whose code is timed")
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()
sys.path.insert(0, args.src)

import torch  # noqa: E402

import logprobs  # noqa: E402
import records  # noqa: E402
import rollout  # noqa: E402
import sat  # noqa: E402
import update  # noqa: E402
from tasks import load_task  # noqa: E402
from team import Agent, Team, TeamConfig, warm_start  # noqa: E402

PHASES = ["rollout", "behaviour lp", "update", "KL checks"]
seconds = {p: 0.0 for p in PHASES}
tokens = {p: 0 for p in PHASES}


def timed(phase: str, fn, count):
    """fn, with its wall time and the response tokens it processed added to ``phase``."""
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        seconds[phase] += time.perf_counter() - t0
        tokens[phase] += count(a, out)
        return out
    return wrapper


rollout.generate = timed("rollout", rollout.generate, lambda a, out: sum(len(r) for r in out))
rollout.batched_response_logprobs = timed("behaviour lp", rollout.batched_response_logprobs, lambda a, out: int(a[1][3].sum()))
update._gradient_step = timed("update", update._gradient_step, lambda a, out: int(a[1].turn.response_mask[a[2]].sum()))
kl_count = lambda a, out: int(a[2].response_mask.sum())  # noqa: E731
update.measure_kl = timed("KL checks", logprobs.measure_kl, kl_count)
sat.measure_kl = timed("KL checks", logprobs.measure_kl, kl_count)
batches = []
_team_rollout = sat.team_rollout
sat.team_rollout = lambda *a, **kw: batches.append(_team_rollout(*a, **kw)) or batches[-1]


def config() -> sat.Config:
    if args.workload == "tiny":
        cfg = sat.Config(seed=args.seed, warmup_steps=args.warmup_steps)
    else:  # the matched workload: 16 prompts x G=4, 32 new tokens, 192 responses a stage, one epoch
        cfg = sat.Config(seed=args.seed, warmup_steps=args.warmup_steps, batch_size=64, group_size=4, max_new_tokens=32,
                         epochs=1, minibatch_size=16, eval_size=64)
    return cfg.apply_preset()


def floor_seconds(team: Team, batch, cfg: sat.Config, steps: dict[int, int]) -> tuple[float, float]:
    """(generate, update) seconds of the bare computation on the stage's shapes."""
    gen = 0.0
    for agent, turn in zip(team.agents, batch.turns):
        gen_cfg = rollout.sampler_config(agent, rollout.SamplingConfig(temperature=cfg.temperature,
                                                                       max_new_tokens=cfg.max_new_tokens))
        t0 = time.perf_counter()
        with torch.no_grad():
            agent.model.generate(input_ids=turn.context_ids, attention_mask=turn.context_mask, generation_config=gen_cfg)
        gen += time.perf_counter() - t0
    upd = 0.0
    for k, turn in enumerate(batch.turns):
        model = copy.deepcopy(team.agents[k].model).train().requires_grad_(True)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        perm = torch.randperm(len(turn.texts))
        turn_like = (turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask)
        t0 = time.perf_counter()
        for s in range(steps[k]):
            idx = perm[(s * cfg.minibatch_size) % len(perm):][: cfg.minibatch_size]
            logp, _ = logprobs.turn_forward(model, turn_like, idx, cfg.temperature)  # [b, Lr]
            opt.zero_grad(set_to_none=True)
            (-logp.sum() / max(1, int(turn.response_mask[idx].sum()))).backward()
            opt.step()
        upd += time.perf_counter() - t0
    return gen, upd


def main() -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    elif hasattr(sat, "configure_threads"):
        sat.configure_threads(None, "cpu")
    cfg = config()
    rng = sat.seed_everything(cfg.seed)
    train, heldout, instruction = load_task(cfg)
    if args.workload == "tiny":
        team = sat.build_team(cfg, instruction)
    else:  # the same checkpoint as all three agents
        one = Agent.load("tiny", seed=cfg.seed)
        team = Team([one] + [Agent(one.spec, copy.deepcopy(one.model), one.tokenizer) for _ in range(2)],
                    TeamConfig(protocol=cfg.protocol, instruction=instruction))
    if cfg.warmup_steps:
        warm_start(team, train, cfg.warmup_steps, cfg.warmup_p_wrong, cfg.seed)
    sampling = rollout.SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                      token_budget=cfg.token_budget, backend="hf")
    controllers = {k: sat.QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta) for k in range(len(team))}
    prompts = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size // cfg.group_size)]
    t0 = time.perf_counter()
    rec = sat.sat_stage(team, prompts, cfg, sampling, controllers, {}, rng)
    stage = time.perf_counter() - t0
    phase_seconds, phase_tokens = dict(seconds), dict(tokens)  # the evaluation below generates too
    batch = batches[0]
    t0 = time.perf_counter()
    sat.evaluate(team, heldout, sampling, cfg)
    evaluation = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        records.save_checkpoint(Path(tmp), 1, team, controllers, {}, rng, {})
        checkpoint = time.perf_counter() - t0
    steps = {a["agent"] - 1: a["inner_steps"] for a in rec["agents"]}
    gen_floor, upd_floor = floor_seconds(team, batch, cfg, steps)
    floor = gen_floor + upd_floor
    load = os.getloadavg()[0]
    print(f"workload {args.workload}: {len(batch)} joint trajectories x {len(team)} agents, max_new_tokens "
          f"{cfg.max_new_tokens}, {batch.num_tokens} response tokens, gradient steps {list(steps.values())}; "
          f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"load average {load:.2f}; code {args.src}")
    print(f"{'phase':<14}{'seconds':>9}{'tokens/s':>11}")
    for p in PHASES:
        print(f"{p:<14}{phase_seconds[p]:>9.2f}{phase_tokens[p] / max(phase_seconds[p], 1e-9):>11.0f}")
    print(f"{'other':<14}{stage - sum(phase_seconds.values()):>9.2f}")
    print(f"{'stage':<14}{stage:>9.2f}{batch.num_tokens / stage:>11.0f}")
    print(f"{'evaluation':<14}{evaluation:>9.2f}")
    print(f"{'checkpoint':<14}{checkpoint:>9.2f}")
    print(f"floor: generate {gen_floor:.2f}s + update {upd_floor:.2f}s = {floor:.2f}s; "
          f"stage/floor {stage / floor:.2f}x; (stage + evaluation + checkpoint)/floor "
          f"{(stage + evaluation + checkpoint) / floor:.2f}x")


if __name__ == "__main__":
    main()
