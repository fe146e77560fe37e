"""One SAT stage, phase by phase, against its compute floor.

Times one stage of Algorithm 1 (paper, Section 5: rollout, then per agent the
Eq. (5) update inside its trust region) as ``sat.py`` runs it, then the
held-out evaluation and the checkpoint ``sat.run`` adds to every stage, and
splits the time into phases (by timing the functions that do each phase):

    rollout        ``rollout.generate``: one batched generate per agent turn
    behaviour lp   ``rollout.batched_response_logprobs``: the behaviour log-probs (with a core
                   idle, ``parallel.idle_core``, those of all agents but the last run in a
                   forked child while the next agent generates: not counted here; a wait for
                   them falls in "other")
    update         ``update._gradient_step``: forward + backward + AdamW step
    KL checks      ``measure_kl``: the exact per-state KL (in-loop and line search), in this
                   process (the line search's first backtrack, measured in a forked child
                   during the in-loop check, is not counted; a wait for it falls in "other"; nor are
                   the in-loop checks speculated in a forked child while training goes on,
                   ``update._speculate``: their count is printed)
    other          the rest of the stage (advantages, copies of pi_j,cur, ...)
    evaluation     ``sat.evaluate`` on the held-out problems
    checkpoint     ``records.save_checkpoint`` (timed here in the main process; ``sat.run`` writes
                   it in a forked child on the second core while the next stage runs)

Tokens/s count response tokens (the rows' generated tokens) that the phase
processes. The compute floor is measured in the same process on the same
shapes: per agent turn one bare ``model.generate`` over the stage's contexts,
plus, per agent, as many forward + backward + AdamW steps on minibatches of
the same rows as the stage took (the plain forward: every row's context
computed). stage/floor is the stage (without evaluation and checkpoint) over
that floor. Beside it, the shared-prefix floor: the same steps through
``logprobs.shared_prefix_hidden_states`` (each distinct context once, what the
run does with ``--share-prefix``, its default on the tiny preset, in the turns
where that computes fewer tokens: ``logprobs.prefix_sharing_pays``, every turn
of the tiny stage, none of the matched workload's), and
stage/shared-prefix floor; and the tightest floor: that update plus generate
with each distinct context prefilled once (``rollout._distinct_prefill``, what
the run's rollout does), and stage/tightest floor.

    python bench/stage.py                          # the tiny default stage
    python bench/stage.py --workload matched       # 16 prompts x G=4, 32 new tokens, one checkpoint x3
    python bench/stage.py --src /path/to/other/checkout   # the same bench on another version of the code
    python bench/stage.py --repeat 5               # median of 5 timings of the same stage

``--repeat K`` (default 3) times the SAME stage K times: each repeat starts
from a fresh copy of the one warm team, with fresh controllers and the same
seeds, so every repeat computes the same thing (same samples, same steps);
each phase, the floor and the ratio are reported as the median over the
repeats (the ratio is the median of the per-repeat ratios), with min-max.

Timings depend on the machine's load: report ``uptime`` with them. On a
loaded machine ``--clock cpu`` times this process's CPU seconds instead of
wall seconds: what the main process computes, without the time it waits for
the CPU (nor the work of forked children on the other core, which an idle
machine would run beside it, nor any wait for them).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import statistics
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
ap.add_argument("--share-prefix", action=argparse.BooleanOptionalAction, default=None,
                help="the run's --share-prefix (default: the config's default; ignored by a checkout without it)")
ap.add_argument("--repeat", type=int, default=3, help="time the same stage this many times; report medians")
ap.add_argument("--assume-idle-core", action="store_true",
                help="fork the overlapping work even when the other core looks busy (parallel.idle_core)")
ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                help="wall: time.perf_counter; cpu: this process's CPU time (time.process_time; forked children "
                     "excluded), a proxy for the idle-machine wall time of the critical path on a loaded machine")
args = ap.parse_args()
sys.path.insert(0, args.src)
clock = time.perf_counter if args.clock == "wall" else time.process_time

import torch  # noqa: E402

import logprobs  # noqa: E402
import records  # noqa: E402
import rollout  # noqa: E402
import sat  # noqa: E402
import update  # noqa: E402
from tasks import load_task  # noqa: E402
from team import Agent, Team, TeamConfig, warm_start  # noqa: E402

import parallel  # noqa: E402

if hasattr(parallel, "freeze_libraries"):  # the state sat.py's CLI process runs in (a checkout without it: none)
    import atexit  # noqa: E402
    import gc  # noqa: E402

    parallel.freeze_libraries()
    atexit.register(gc.unfreeze)  # the interpreter's own exit frees them (left frozen, nanobind reports leaks)

PHASES = ["rollout", "behaviour lp", "update", "KL checks"]
seconds = {p: 0.0 for p in PHASES}
tokens = {p: 0 for p in PHASES}
calls = {p: 0 for p in PHASES}


def timed(phase: str, fn, count):
    """fn, with its wall time and the response tokens it processed added to ``phase``."""
    def wrapper(*a, **kw):
        t0 = clock()
        out = fn(*a, **kw)
        seconds[phase] += clock() - t0
        tokens[phase] += count(a, out)
        calls[phase] += 1
        return out
    return wrapper


if args.assume_idle_core:
    parallel.idle_core = parallel.spare_core  # (a checkout without idle_core: no effect)
rollout.generate = timed("rollout", rollout.generate, lambda a, out: sum(len(r) for r in out))
rollout.batched_response_logprobs = timed("behaviour lp", rollout.batched_response_logprobs, lambda a, out: int(a[1][3].sum()))
update._gradient_step = timed("update", update._gradient_step, lambda a, out: int(a[1].turn.response_mask[a[2]].sum()))
kl_count = lambda a, out: int(a[2].response_mask.sum())  # noqa: E731
update.measure_kl = timed("KL checks", logprobs.measure_kl, kl_count)
sat.measure_kl = timed("KL checks", logprobs.measure_kl, kl_count)
speculated = []  # in-loop checks measured in a forked child (update._speculate; absent in older checkouts)
if hasattr(update, "_speculate"):
    update._speculate = (lambda f: lambda *a: speculated.append(1) or f(*a))(update._speculate)
batches = []
_team_rollout = sat.team_rollout
sat.team_rollout = lambda *a, **kw: batches.append(_team_rollout(*a, **kw)) or batches[-1]


def config() -> sat.Config:
    if args.workload == "tiny":
        cfg = sat.Config(seed=args.seed, warmup_steps=args.warmup_steps)
    else:  # the matched workload: 16 prompts x G=4, 32 new tokens, 192 responses a stage, one epoch
        cfg = sat.Config(seed=args.seed, warmup_steps=args.warmup_steps, batch_size=64, group_size=4, max_new_tokens=32,
                         epochs=1, minibatch_size=16, eval_size=64)
    if args.share_prefix is not None and hasattr(cfg, "share_prefix"):
        cfg.share_prefix = args.share_prefix
    return cfg.apply_preset()


def floor_seconds(team: Team, batch, cfg: sat.Config, steps: dict[int, int]) -> tuple[float, float, float | None, float | None]:
    """(generate, update, update with shared-prefix forwards or None, generate
    with each distinct context prefilled once or None) seconds of the bare
    computation on the stage's shapes."""
    def bare_generate(prefill) -> float:
        gen = 0.0
        for agent, turn in zip(team.agents, batch.turns):
            gen_cfg = rollout.sampler_config(agent, rollout.SamplingConfig(temperature=cfg.temperature,
                                                                           max_new_tokens=cfg.max_new_tokens))
            t0 = clock()
            with torch.no_grad(), prefill(agent.model):
                agent.model.generate(input_ids=turn.context_ids, attention_mask=turn.context_mask, generation_config=gen_cfg)
            gen += clock() - t0
        return gen

    distinct_prefill = getattr(rollout, "_distinct_prefill", None)  # (a checkout without it: no such floor)
    gen = bare_generate(lambda model: contextlib.nullcontext())
    upd = floor_update(team, batch, cfg, steps, logprobs.response_hidden_states)
    shared = getattr(logprobs, "shared_prefix_hidden_states", None)  # (a checkout without it: no shared-prefix floor)
    return (gen, upd, floor_update(team, batch, cfg, steps, shared) if shared else None,
            bare_generate(distinct_prefill) if distinct_prefill else None)


def floor_update(team: Team, batch, cfg: sat.Config, steps: dict[int, int], hidden_states) -> float:
    """Seconds of the stage's gradient steps as bare forward (``hidden_states``)
    + fp32 head + backward + AdamW steps on minibatches of the same rows."""
    upd = 0.0
    for k, turn in enumerate(batch.turns):
        model = copy.deepcopy(team.agents[k].model).train().requires_grad_(True)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        perm = torch.randperm(len(turn.texts), generator=torch.Generator().manual_seed(k))
        turn_like = (turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask)
        t0 = clock()
        for s in range(steps[k]):
            idx = perm[(s * cfg.minibatch_size) % len(perm):][: cfg.minibatch_size]
            ctx, cmask, resp, rmask = [t[idx] for t in turn_like]
            hidden = hidden_states(model, ctx, cmask, resp, rmask)  # [b, Lr, H]
            logp = logprobs.token_logprobs_from_hidden(model, hidden, resp, cfg.temperature) * rmask  # [b, Lr]
            opt.zero_grad(set_to_none=True)
            (-logp.sum() / max(1, int(rmask.sum()))).backward()
            opt.step()
        upd += clock() - t0
    return upd


def main() -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    elif hasattr(sat, "configure_threads"):
        sat.configure_threads(None, "cpu")
    cfg = config()
    if hasattr(logprobs, "prefix_sharing_pays"):  # as sat.run does: shared in the turns where it pays
        logprobs.set_share_prefix(cfg.share_prefix, cfg.minibatch_size, cfg.token_budget)
    elif hasattr(logprobs, "set_share_prefix"):  # an older checkout: shared in every turn (without it: the plain forward)
        logprobs.set_share_prefix(cfg.share_prefix)
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
    prompts = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size // cfg.group_size)]
    warm = copy.deepcopy(team)
    runs = []
    for r in range(args.repeat):
        runs.append(one_stage(copy.deepcopy(warm), prompts, heldout, cfg, sampling))
    batch, steps = runs[0]["batch"], runs[0]["steps"]
    load = os.getloadavg()[0]
    print(f"workload {args.workload}: {len(batch)} joint trajectories x {len(team)} agents, max_new_tokens "
          f"{cfg.max_new_tokens}, {batch.num_tokens} response tokens, gradient steps {list(steps.values())}; "
          f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"load average {load:.2f}; clock {args.clock}; code {args.src}" + ("; --assume-idle-core" if args.assume_idle_core else ""))
    print("per agent: " + "; ".join(f"agent {a['agent']}: {a['inner_steps']} steps, early stop {a['early_stopped']}, "
                                    f"backtracks {a['backtracks']}, fraction {a['step_fraction']}" for a in runs[0]["agents"])
          + f"; in-loop checks speculated in a child: {[run['speculated'] for run in runs]}")
    if any(run["steps"] != steps for run in runs):
        print(f"warning: the repeats took different gradient steps: {[list(run['steps'].values()) for run in runs]}")
    med = lambda key: statistics.median(run[key] for run in runs)  # noqa: E731
    span = lambda key: f"{min(run[key] for run in runs):.2f}-{max(run[key] for run in runs):.2f}"  # noqa: E731
    print(f"median of {len(runs)} repeats of the same stage (fresh copies of one warm team, same seeds)")
    print(f"{'phase':<14}{'seconds':>9}{'min-max':>12}{'tokens/s':>11}{'calls':>7}")
    for p in PHASES + ["other", "stage", "evaluation", "checkpoint"]:
        per_s = f"{runs[0]['tokens'][p] / max(med(p), 1e-9):>11.0f}" if p in PHASES else (
            f"{batch.num_tokens / med(p):>11.0f}" if p == "stage" else "")
        n_calls = f"{runs[0]['calls'][p]:>7}" if p in PHASES else ""
        print(f"{p:<14}{med(p):>9.2f}{span(p):>12}{per_s}{n_calls}")
    print(f"floor: generate {med('gen_floor'):.2f}s ({span('gen_floor')}) + update {med('upd_floor'):.2f}s "
          f"({span('upd_floor')}) = {med('floor'):.2f}s ({span('floor')}); stage/floor {med('ratio'):.2f}x "
          f"({span('ratio')}); (stage + evaluation + checkpoint)/floor {med('ratio_all'):.2f}x ({span('ratio_all')})")
    if "floor_shared" in runs[0]:
        print(f"shared-prefix floor (the same steps through logprobs.shared_prefix_hidden_states): generate "
              f"{med('gen_floor'):.2f}s + update {med('upd_floor_shared'):.2f}s ({span('upd_floor_shared')}) = "
              f"{med('floor_shared'):.2f}s ({span('floor_shared')}); stage/shared-prefix floor {med('ratio_shared'):.2f}x "
              f"({span('ratio_shared')})")
    if "floor_tight" in runs[0]:
        print(f"tightest floor (generate with each distinct context prefilled once, rollout._distinct_prefill, + the "
              f"shared-prefix update): generate {med('gen_floor_distinct'):.2f}s ({span('gen_floor_distinct')}) + update "
              f"{med('upd_floor_shared'):.2f}s = {med('floor_tight'):.2f}s ({span('floor_tight')}); stage/tightest floor "
              f"{med('ratio_tight'):.2f}x ({span('ratio_tight')})")


def one_stage(team: Team, prompts, heldout, cfg: sat.Config, sampling) -> dict:
    """Time one stage (same seeds every call), its evaluation and checkpoint, and its floor."""
    for p in PHASES:
        seconds[p], tokens[p], calls[p] = 0.0, 0, 0
    batches.clear()
    speculated.clear()
    rng = random.Random(cfg.seed + 1)
    torch.manual_seed(cfg.seed + 1)
    controllers = {k: sat.QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta) for k in range(len(team))}
    t0 = clock()
    rec = sat.sat_stage(team, prompts, cfg, sampling, controllers, {}, rng)
    stage = clock() - t0
    out = {**seconds, "tokens": dict(tokens), "calls": dict(calls), "stage": stage, "batch": batches[0],
           "speculated": len(speculated)}  # the evaluation below generates too
    out["other"] = stage - sum(seconds[p] for p in PHASES)
    t0 = clock()
    sat.evaluate(team, heldout, sampling, cfg)
    out["evaluation"] = clock() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = clock()
        records.save_checkpoint(Path(tmp), 1, team, controllers, {}, rng, {})
        out["checkpoint"] = clock() - t0
    out["steps"] = {a["agent"] - 1: a["inner_steps"] for a in rec["agents"]}
    out["agents"] = rec["agents"]
    out["gen_floor"], out["upd_floor"], upd_shared, gen_distinct = floor_seconds(team, out["batch"], cfg, out["steps"])
    out["floor"] = out["gen_floor"] + out["upd_floor"]
    out["ratio"] = stage / out["floor"]
    if upd_shared is not None:
        out["upd_floor_shared"], out["floor_shared"] = upd_shared, out["gen_floor"] + upd_shared
        out["ratio_shared"] = stage / out["floor_shared"]
    if upd_shared is not None and gen_distinct is not None:
        out["gen_floor_distinct"], out["floor_tight"] = gen_distinct, gen_distinct + upd_shared
        out["ratio_tight"] = stage / out["floor_tight"]
    out["ratio_all"] = (stage + out["evaluation"] + out["checkpoint"]) / out["floor"]
    return out

if __name__ == "__main__":
    main()
