"""The built-in games (harness/env_games.py, harness/planbench.py) against their definitions: AR-Bench's guessing
numbers (feedback by brute force over digit pairs, the final guess scored, information gained counted by hand),
PlanBench's blocksworld (its STRIPS domain action by action, its 500 ground-truth plans, shortest plans by an
independent search), and rewards that pay only for progress: scripted idle and random teams earn under BOUND."""
import itertools
import json
import math
import random
import re
from collections import deque
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import game_baselines as baselines
from harness import env_games as games
from harness import planbench as pb
from harness.environments import EnvironmentFault, game_problems, load_environment, play

ROOT = Path(__file__).resolve().parents[1]
GN_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "gn_secrets.json"  # AR-Bench's data/gn format
BOUND = 0.05  # the most an idle or random team may earn on average, per game and size
EPISODES = 300


# -- Guessing numbers -----------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.permutations("0123456789"), st.lists(st.sampled_from("0123456789"), min_size=4, max_size=4),
       st.integers(2, 4))
def test_gn_feedback_is_the_count_over_digit_pairs(perm, guess, digits):
    secret, guess = "".join(perm[:digits]), "".join(guess[:digits])
    in_place = sum(secret[i] == guess[i] for i in range(digits))
    matched = sum(min(secret.count(d), guess.count(d)) for d in set(guess))
    assert games.gn_feedback(secret, guess) == (in_place, matched - in_place)


def test_gn_secret_is_distinct_digits_and_a_function_of_the_seed():
    for seed in range(50):
        s = games.gn_secret(seed, 4)
        assert len(set(s)) == 4 and s == games.gn_secret(seed, 4)
    assert len({games.gn_secret(seed, 4) for seed in range(50)}) > 40


def gn_play(secret: str, rounds: list[list[str]], budget: int) -> tuple[list[str], float, list[bool]]:
    """(observations, reward, done flags) of an episode on a known secret."""
    env = games.GuessNumbers()
    env.reset(secret=secret, rounds=budget)
    seen, dones = [], []
    for replies in rounds:
        obs, done = env.step(replies)
        seen.append(obs)
        dones.append(done)
    return seen, env.get_reward(), dones


def test_gn_plays_every_round_and_scores_only_the_final_guess():
    seen, reward, dones = gn_play("12", [["12"], ["34"], ["99", "21"]], budget=3)
    assert dones == [False, False, True] and reward == 0.0  # right in round 1, wrong (and inconsistent) at the end
    assert seen[-1].endswith("Final answer 21: the secret was 12.")
    seen, reward, _ = gn_play("12", [["34"], ["56"], ["x", "12", "no guess"]], budget=3)
    assert reward == 1.0 and seen[-1].endswith("that is the secret number.")  # the latest well-formed guess counts
    assert gn_play("12", [["34"], ["", ""]], budget=2)[1] == 0.0  # no final guess


def test_gn_partial_credit_is_the_information_a_consistent_final_guess_carries():
    # 2 digits: N0 = 10 * 9 = 90 secrets. "34" -> 0 and 0 rules out every secret with a 3 or a 4: 8 * 7 = 56 left.
    _, reward, _ = gn_play("12", [["34"], ["56"]], budget=2)
    assert reward == pytest.approx(0.5 * math.log(90 / 56) / math.log(90))
    assert gn_play("12", [["34"], ["35"]], budget=2)[1] == 0.0  # a final guess the feedback ruled out
    assert gn_play("12", [["34"], ["55"]], budget=2)[1] == 0.0  # consistent with "34", but never a secret
    # "13" -> 1 in place, 0 elsewhere: either the 1 is in place (second digit not 1 or 3: 8 secrets) or the 3 is
    # (first digit not 1 or 3: 8 secrets): 16 left, and "15" is one of them.
    _, reward, _ = gn_play("12", [["13"], ["15"]], budget=2)
    assert reward == pytest.approx(0.5 * math.log(90 / 16) / math.log(90))
    assert gn_play("12", [["56"]], budget=1)[1] == 0.0  # no feedback before the final guess: nothing learned


def test_gn_information_counts_the_secrets_left_by_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        secret = "".join(rng.sample("0123456789", 3))
        history = [(g, games.gn_feedback(secret, g)) for g in ("".join(rng.sample("0123456789", 3)) for _ in range(2))]
        left = [c for c in map("".join, itertools.permutations("0123456789", 3))
                if all(games.gn_feedback(c, g) == fb for g, fb in history)]
        assert secret in left
        assert games.gn_information(history, 3) == pytest.approx(math.log(720 / len(left)) / math.log(720))


def test_gn_a_team_that_reads_the_feedback_earns_what_a_random_one_does_not():
    """Every agent guesses a secret the feedback still allows: most episodes solved, far above BOUND."""
    rewards = []
    for seed in range(20):
        env = games.GuessNumbers()
        env.reset(seed=2 * seed + 1, digits=4)
        left = ["".join(c) for c in itertools.permutations("0123456789", 4)]
        rng = random.Random(seed)
        for _ in range(env.rounds):
            guesses = [rng.choice(left) for _ in range(3)]
            env.step(guesses)
            for g, fb in env.history[-1]:
                left = [c for c in left if games.gn_feedback(c, g) == fb]
        rewards.append(env.get_reward())
    assert sum(rewards) / len(rewards) > 0.7


def test_gn_reads_ar_bench_secret_files_and_splits_them_apart():
    secrets = json.loads(GN_FIXTURE.read_text())
    train = game_problems("guess-numbers", {"secrets": str(GN_FIXTURE)}, 100, seed=0, split="train", rounds=5)
    held = game_problems("guess-numbers", {"secrets": str(GN_FIXTURE)}, 100, seed=0, split="heldout")
    assert sorted(p.columns["secret"] for p in train + held) == sorted(secrets)
    assert len(train) == (len(secrets) + 1) // 2 and all(p.columns["rounds"] == 5 for p in train)
    env = load_environment("env:guess-numbers")
    p = held[0]
    assert play(env, p, [[p.columns["secret"]]] * 8)[1] == 1.0


@pytest.mark.parametrize("content, expected", [
    ("[\"1234\", \"1123\"]", "item 1 is '1123'; each secret is a string of distinct digits, all of one length"),
    ("{\"a\": 1}", "not a non-empty JSON list"),
    ("[1234", "cannot read it as JSON (JSONDecodeError)"),
])
def test_a_malformed_secrets_file_is_one_line(tmp_path, content, expected):
    path = tmp_path / "gn.json"
    path.write_text(content)
    with pytest.raises(EnvironmentFault, match=re.escape(f"--task-option secrets={path}: {expected}")):
        game_problems("guess-numbers", {"secrets": str(path)}, 4, seed=0, split="train")


# -- Blocksworld: PlanBench's domain --------------------------------------------------------------------------------
def test_each_action_has_exactly_the_domain_files_preconditions_and_effects():
    s = frozenset({("handempty",), ("ontable", "a"), ("on", "b", "a"), ("clear", "b"), ("ontable", "c"),
                   ("clear", "c")})
    assert pb.apply(s, "pick-up", ("a",)) == ("clear", "a")  # a has b on it
    held = pb.apply(s, "unstack", ("b", "a"))
    assert held == frozenset({("ontable", "a"), ("clear", "a"), ("holding", "b"), ("ontable", "c"), ("clear", "c")})
    assert pb.apply(held, "pick-up", ("c",)) == ("handempty",)
    assert pb.apply(held, "stack", ("b", "b")) == ("clear", "b")  # a held block is not clear: no stacking on itself
    assert pb.apply(held, "stack", ("b", "c")) == frozenset(
        {("ontable", "a"), ("clear", "a"), ("handempty",), ("on", "b", "c"), ("clear", "b"), ("ontable", "c")})
    assert pb.apply(held, "put-down", ("a",)) == ("holding", "a")
    assert pb.apply(s, "unstack", ("c", "a")) == ("on", "c", "a")


def shortest_plan(objects, state, goal) -> int:
    """Breadth-first over every ground action (no pruning): the fewest actions to the goal."""
    seen, frontier = {state}, deque([(state, 0)])
    while frontier:
        current, depth = frontier.popleft()
        if goal <= current:
            return depth
        for name, args in pb.ground_actions(objects):
            nxt = pb.apply(current, name, args)
            if isinstance(nxt, frozenset) and nxt not in seen:
                seen.add(nxt)
                frontier.append((nxt, depth + 1))
    raise AssertionError("unreachable")


def plan_words(plan: list[str]) -> str:
    """PlanBench's ground-truth lines ("(unstack yellow orange)") in its action words."""
    out = []
    for line in plan:
        verb, *args = line.strip("()").split()
        out.append(pb.PHRASES[verb].format(*args))
    return "\n".join(out)


def test_planbench_ground_truth_plans_are_exactly_the_plans_that_solve():
    """Each of the 500 ground-truth plans (VAL-valid, made by PlanBench's planner) solves its instance in full and
    is a shortest plan; with its first action dropped it is refused at the first action whose precondition fails."""
    rows = pb.shipped_instances()
    assert len(rows) == 501 and {len(r["objects"]) for r in rows} == {4, 5}
    env = load_environment("env:blocksworld")
    for r in rows:
        if r["plan"] is None:
            continue
        episode = games.Blocksworld()
        episode.reset(objects=r["objects"], init=r["init"], goal=r["goal"])
        obs, done = episode.step([plan_words(r["plan"])])
        assert done and episode.get_reward() == 1.0 and len(episode.plan) == len(r["plan"]), r["instance"]
        assert episode.start_distance == len(r["plan"])
        short = games.Blocksworld()
        short.reset(objects=r["objects"], init=r["init"], goal=r["goal"])
        obs, done = short.step([plan_words(r["plan"][1:])])
        assert not done and ": it needs that " in obs
    p = game_problems("blocksworld", {"instances": "planbench"}, 1, seed=0, split="heldout")[0]
    assert play(env, p, [[plan_words(next(r for r in rows if r["instance"] == p.id[len("blocksworld-"):])["plan"])]])[
        1] == 1.0


def test_the_shortest_plan_search_agrees_with_an_unpruned_one():
    for r in pb.shipped_instances()[:25]:
        init, goal = frozenset(map(tuple, r["init"])), frozenset(map(tuple, r["goal"]))
        assert pb.plan_length(init, goal, r["objects"]) == shortest_plan(r["objects"], init, goal)
    for seed in range(15):
        objects, init, goal = games.bw_problem(seed, 3 + seed % 3)
        assert pb.plan_length(init, goal, objects) == shortest_plan(objects, init, goal)


def test_a_users_folder_of_pddl_files_plays_and_a_bad_file_is_one_line(tmp_path):
    rows = pb.shipped_instances()
    for r in rows[:5]:
        init = " ".join(f"({' '.join(f)})" for f in r["init"])
        goal = " ".join(f"({' '.join(f)})" for f in r["goal"])
        (tmp_path / f"{r['instance']}.pddl").write_text(
            f"(define (problem p) (:domain blocksworld-4ops) (:objects {' '.join(r['objects'])})\n"
            f"(:init {init}) ; a comment\n(:goal (and {goal})))\n")
    (tmp_path / "domain.pddl").write_text("(define (domain blocksworld-4ops) (:requirements :strips))")
    train = game_problems("blocksworld", {"instances": str(tmp_path)}, 10, seed=3, split="train")
    held = game_problems("blocksworld", {"instances": str(tmp_path)}, 10, seed=3, split="heldout")
    assert sorted(p.id for p in train + held) == sorted(f"blocksworld-{r['instance']}" for r in rows[:5])
    assert {p.id for p in train}.isdisjoint(p.id for p in held)
    by_id = {f"blocksworld-{r['instance']}": r for r in rows}
    for p in train + held:
        assert all(p.columns[k] == by_id[p.id][k] for k in ("objects", "init", "goal"))
    (tmp_path / "instance-9.pddl").write_text("(define (problem p) (:objects a b) (:init (on a z)) (:goal (on a b)))")
    with pytest.raises(EnvironmentFault, match=r"instance-9.pddl: \(on a z\) is not a fact of blocksworld-4ops over "):
        game_problems("blocksworld", {"instances": str(tmp_path)}, 10, seed=3, split="train")
    with pytest.raises(EnvironmentFault, match="no such folder; give a folder of PDDL problem files or 'planbench'"):
        game_problems("blocksworld", {"instances": str(tmp_path / "none")}, 10, seed=3, split="train")


def test_the_opening_is_planbenchs_words():
    r = pb.shipped_instances()[1]  # instance-2: PlanBench's own prompt for it, checked against their prompt file
    opening = games.Blocksworld().reset(objects=r["objects"], init=r["init"], goal=r["goal"])
    assert opening.startswith(pb.DOMAIN_INTRO)
    assert ("As initial conditions I have that, the red block is clear, the yellow block is clear, the hand is empty, "
            "the red block is on top of the blue block, the yellow block is on top of the orange block, the blue "
            "block is on the table and the orange block is on the table.\nMy goal is to have that the orange block "
            "is on top of the red block.") in opening


# -- Blocksworld: the reward ----------------------------------------------------------------------------------------
THREE = {"objects": ["a", "b", "c"], "init": [["handempty"], ["ontable", "a"], ["ontable", "b"], ["ontable", "c"],
                                              ["clear", "a"], ["clear", "b"], ["clear", "c"]],
         "goal": [["on", "a", "b"]]}  # red on blue, from three blocks on the table: 2 actions


@pytest.mark.parametrize("actions, reward", [
    ([], 0.0),
    (["pick up the red block"], 0.5 * (2 - 1) / 2),
    (["pick up the red block", "put down the red block"], 0.0),  # lifted and put back: no progress
    (["pick up the blue block", "stack the blue block on top of the red block"], 0.5 * (2 - 4) / 2),  # away
    (["pick up the orange block", "stack the orange block on top of the red block"], 0.5 * (2 - 4) / 2),
    (["pick up the red block", "stack the red block on top of the blue block"], 1.0),
    (["stack the red block on top of the blue block"], 0.0),  # refused: the hand holds nothing
])
def test_blocksworld_reward_is_the_share_of_the_shortest_plan_closed(actions, reward):
    env = games.Blocksworld()
    env.reset(**THREE)
    env.step(["\n".join(actions)])
    assert env.get_reward() == pytest.approx(reward)


def test_blocksworld_refusal_names_the_failing_precondition_and_stops_that_agent_only():
    env = games.Blocksworld()
    env.reset(**THREE)
    obs, done = env.step(["put down the red block\npick up the red block", "pick up the blue block",
                          "pick up the orange block"])
    assert obs.splitlines() == [
        "Agent 1: cannot put down the red block: it needs that the hand is currently holding the red block.",
        "Agent 3: cannot pick up the orange block: it needs that the hand is empty.",
        "Now: the red block is clear, the orange block is clear, the hand is currently holding the blue block, the red "
        "block is on the table and the orange block is on the table."]
    assert env.plan == [("pick-up", ("b",))] and not done
    env = games.Blocksworld()
    env.reset(**THREE)
    obs, _ = env.step(["pick up the green block", "pick up the blue block"])
    assert obs.startswith("Agent 1: cannot pick up the green block: there is no green block.")
    assert env.plan == [("pick-up", ("b",))]


@pytest.mark.parametrize("blocks", [3, 4, 5])
def test_no_episode_is_solved_at_reset(blocks):
    for p in game_problems("blocksworld", {"blocks": str(blocks)}, 1500, seed=0, split="heldout"):
        env = games.Blocksworld()
        env.reset(**p.columns)
        assert not env.goal <= env.state and env.start_distance >= 1 and env.get_reward() == 0.0
    for r in pb.shipped_instances():
        assert not frozenset(map(tuple, r["goal"])) <= frozenset(map(tuple, r["init"]))


# -- Rewards that pay only for progress -----------------------------------------------------------------------------
@pytest.mark.parametrize("game, options, policy", [
    ("guess-numbers", {"digits": 4}, "idle"), ("guess-numbers", {"digits": 4}, "random"),
    ("guess-numbers", {"digits": 3}, "random"),
    *[("blocksworld", {"blocks": b}, p) for b in (3, 4, 5) for p in ("idle", "random", "lift-and-replace")],
    *[("blocksworld", {"instances": "planbench"}, p) for p in ("idle", "random", "lift-and-replace")],
])
def test_an_idle_or_random_team_earns_under_the_bound(game, options, policy):
    rng = random.Random(f"{game} {policy}")
    rows = [row for _, row in games.game_rows(game, options, EPISODES, 0, "heldout")]
    results = [baselines.play(game, row, policy, rng) for row in rows]
    rewards = [r for r, _, _ in results]
    assert sum(rewards) / len(rewards) < BOUND
    assert not any(at_reset for _, _, at_reset in results)


@pytest.mark.parametrize("options", [{"blocks": 3}, {"blocks": 4}, {"blocks": 5}, {"instances": "planbench"}])
def test_a_random_walk_earns_no_partial_credit(options):
    """A team that takes random applicable actions reaches the goal by chance on small problems (a real solve); the
    episodes it does not solve earn under 0 on average: wandering is not progress."""
    rng = random.Random(f"walk {options}")
    rows = [row for _, row in games.game_rows("blocksworld", options, EPISODES, 0, "heldout")]
    results = [baselines.play("blocksworld", row, "random-valid", rng) for row in rows]
    unsolved = [r for r, solved, _ in results if not solved]
    assert sum(unsolved) / len(unsolved) < 0.0


# -- Success is the headline --------------------------------------------------------------------------------------
def test_success_heads_the_stage_lines_and_the_eval_table():
    from harness import records
    from harness.eval_folder import markdown_table

    agent = {"kl_quantile": 0.01, "backtracks": 0, "accepted": True}
    rec = {"stage": 2, "team_reward": 0.1, "agents": [agent], "seconds": 3.0, "success": 0.125, "eval_success": 0.25}
    assert records.stage_line(rec).endswith("  solved train 0.125 held-out 0.250")
    assert "solved" not in records.stage_line({k: v for k, v in rec.items() if "success" not in k})
    zero = {"eval_success": 0.0625, "eval_accuracy": 0.1, "eval_agent_reward": [0.1]}
    assert records.stage_zero_line(zero).startswith("stage 0 (before SAT): solved 0.062 held-out team accuracy 0.100")
    metric = {"value": 0.25, "ci95": [0.1, 0.4]}
    bench = {"metrics": {"team": {n: metric for n in ("avg@2", "pass@1", "pass@2", "maj@2")}},
             "lengths": {"team": {"mean_tokens": 3, "median_tokens": 3, "max_tokens": 4, "truncated": 0.0}},
             "rounds": {"mean": 2.0, "max": 2}, "success": metric}
    assert "| env:blocksworld | **success** (episodes solved) | 25.0 [10.0, 40.0] |" in markdown_table(
        {"env:blocksworld": bench}, 2).splitlines()
