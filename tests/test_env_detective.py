"""ARBench's Detective Cases (harness/env_detective.py, harness/dc_cases.py): generated cases are solvable from
the rules responder's answers alone, a random detective scores chance, episodes replay exactly, the model
responder's chats hold one suspect's card and memory only, and AR-Bench's own case format is read as it is."""
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import env_detective as dc
from harness.dc_cases import generate_case, roles_of
from harness.environments import game_problems, load_environment, play, probe_environment

FIXTURE = Path(__file__).parent / "fixtures" / "arbench_dc_sample.json"
WITNESS_QUESTION = "Did you see anyone near the scene around the time of the murder?"
REPLY = re.compile(r"asked (?P<asked>[^\n]+?) \([A-E]\): [^\n]*\n(?P<speaker>[^\n:]+): (?P<reply>[^\n]*)")


def accused(observations: list[str], names: list[str]) -> Counter:
    """How many other suspects said they saw each suspect ("saw NAME"), read from the observations only."""
    pairs = {(m["speaker"], name) for obs in observations for m in REPLY.finditer(obs) for name in names
             if name != m["speaker"] and f"saw {name}" in m["reply"]}
    return Counter(name for _, name in pairs)


def scripted_detective(row: dict, agents: int) -> tuple[float, list[str]]:
    """Asks every suspect twice what it saw (10 turns), then names the suspect most others saw near the scene:
    the helper and the nervous one (on the second asking) saw the murderer, only the murderer accuses someone
    else, and the accomplice only vouches."""
    env = dc.DetectiveCases()
    seen = [env.reset(**row, turns=10)]
    script = [f"Suspect: {letter}\nQuestion: {WITNESS_QUESTION}" for letter in "ABCDE" * 2]
    while not env.answering:
        seen.append(env.step(script[:agents])[0])
        script = script[agents:]
    names = env.case.names
    votes = accused(seen, names)
    best = max(names, key=lambda n: votes[n])
    assert sorted(votes.values())[-1] > sorted([0, *votes.values()])[-2], f"no unique suspect: {votes}"
    seen.append(env.step(["I have a theory.", f"Answer: {dc.LETTERS[names.index(best)]}"][-agents:])[0])
    return env.get_reward(), seen


@pytest.mark.parametrize("agents", [1, 3])
def test_every_generated_case_is_solved_by_a_detective_who_asks_who_they_saw(agents):
    for seed in range(200):
        reward, _ = scripted_detective({"seed": seed}, agents)
        assert reward == 1.0, f"seed {seed}"


def test_the_arbench_fixture_cases_are_read_as_they_are_and_solved_the_same_way():
    cases = json.loads(FIXTURE.read_text())
    for case in cases:
        roles = roles_of(case["suspects"])
        assert list(roles.values()) == ["murderer", "helper", "accomplice", "nervous", "uninformed"]
        reward, seen = scripted_detective(case, 1)
        assert reward == 1.0
        assert case["initial_information"]["suspect"][case["label"]]["name"] == case["murderer"]


def test_a_random_detective_scores_chance():
    rng = random.Random(0)
    questions = ["Where were you?", "Why did you hate the victim?", "Did you touch the weapon?", "Who did it?",
                 "How did you know the victim?", "What evidence is there?"]
    rewards = []
    for seed in range(1000):
        env = dc.DetectiveCases()
        env.reset(seed=seed, turns=4)
        while not env.answering:
            env.step([f"Suspect: {rng.choice('ABCDE')}\nQuestion: {rng.choice(questions)}"])
        env.step([f"Answer: {rng.choice('ABCDE')}"])
        rewards.append(env.get_reward())
    mean = sum(rewards) / len(rewards)
    assert abs(mean - 0.2) < 0.05  # sd 0.013 over 1000 episodes
    labels = Counter(generate_case(seed)["label"] for seed in range(1000))
    assert all(abs(labels[i] / 1000 - 0.2) < 0.05 for i in range(5))  # a fixed letter scores chance too


def test_the_probe_replays_a_model_responders_episodes_in_a_second_process():
    """With a model responder the probe's second process asks and answers (scripted replies) as the first does."""
    env = load_environment("env:detective-cases")
    problem = game_problems("detective-cases", {"turns": "2", "responder": "SmolLM2-135M"}, 1, seed=0, split="train",
                            rounds=2)[0]
    probe_environment(env, [problem], n_agents=2)


def test_an_episode_replays_exactly_and_cases_are_functions_of_the_seed():
    assert generate_case(7) == generate_case(7) and generate_case(7) != generate_case(8)
    replies = [["Suspect: B\nQuestion: where were you?", "Suspect: Z\nQuestion: hm", "nothing"]] * 4
    replies += [["Answer: C", "Answer: A", "no idea"]]
    env = load_environment("env:detective-cases")
    problem = game_problems("detective-cases", {"turns": "12"}, 1, seed=0, split="train")[0]
    first = play(env, problem, replies)
    assert first == play(env, problem, replies)
    assert first[0][-1] == "The team's answer: Answer: A. The case is closed."  # the last agent's that parses
    probe_environment(env, [problem], n_agents=2)


def test_a_bad_turn_says_the_format_and_is_spent():
    env = dc.DetectiveCases()
    env.reset(seed=1, turns=3)
    obs, done = env.step(["I think the butler did it.", "Suspect: Nobody Atall\nQuestion: who?",
                          "Suspect: A\nQuestion: Where were you?"])
    lines = obs.splitlines()
    assert lines[0] == f"Turn 1, agent 1: {dc.BAD_TURN}" and lines[1] == f"Turn 2, agent 2: {dc.BAD_TURN}"
    assert "Suspect: <name or letter A-E>" in dc.BAD_TURN and "asked" in lines[2] and not done
    assert env.answering and "Answer: X" in obs  # the budget of 3 is spent: the final choice follows


def test_a_suspect_is_named_by_letter_full_name_or_a_unique_word():
    names = ["Dr. Ada Strand", "Judge Basil Thorne", "Captain Cora Vance", "Dr. Felix Oakley", "Professor Iris Kay"]
    assert dc.suspect_of("C", names) == names[2] and dc.suspect_of("b) Judge Basil Thorne", names) == names[1]
    assert dc.suspect_of("judge basil thorne", names) == names[1] and dc.suspect_of("Oakley", names) == names[3]
    assert dc.suspect_of("Dr.", names) is None and dc.suspect_of("Somebody", names) is None
    assert dc.parse_turn("Reasoning...\nSuspect: Vance\nQuestion: Why?\n", names) == (names[2], "Why?")


def test_the_question_budget_maps_to_rounds_and_max_rounds_leaves_the_answer_round():
    assert dc.rounds_needed(25, 1) == 26 == dc.DetectiveCases.max_rounds and dc.rounds_needed(25, 3) == 10
    env = dc.DetectiveCases()
    assert "You have 3 rounds" in env.reset(seed=2, rounds=3)
    env.step(["Suspect: A\nQuestion: where?"])
    obs, done = env.step(["Suspect: B\nQuestion: where?"])
    assert env.answering and obs.endswith(dc.FINAL.splitlines()[-1]) and not done
    assert env.step(["Answer: E"]) [1] and env.rounds_left == 0


def test_the_opening_states_a_round_limit_only_where_it_can_stop_the_questions():
    """The run gives every row T (26 by default): an opening says "26 rounds" nowhere when the 25 questions, or 2,
    end the episode first; a T that can cut the questions short is said with the rule, for any team size."""
    env = load_environment("env:detective-cases")
    for turns in ("25", "2"):
        problem = game_problems("detective-cases", {"turns": turns}, 1, seed=0, split="train",
                                rounds=env.max_rounds)[0]
        opening = env.start(problem)[1]
        assert "26" not in opening and "rounds" not in opening.split("The team has")[1], opening
    opening = dc.DetectiveCases().reset(seed=2, turns=4, rounds=3)
    assert "You have 3 rounds at most: questions until round 2 ends or the budget is spent" in opening
    assert dc.round_limit(3, 2) == "" and dc.round_limit(1, 5) == " You have 1 round: it is for the answer."
    for agents in (1, 2, 3):  # the rule the words give is the episode's: T - 1 question rounds at most
        episode = dc.DetectiveCases()
        episode.reset(seed=2, turns=4, rounds=3)
        played, done = 0, False
        while not done:
            done, played = episode.step(["Suspect: A\nQuestion: where?"] * agents)[1], played + 1
        assert played == min(3, dc.rounds_needed(4, agents))


def run_model_episode(row: dict, script: list[list[str]]) -> tuple[dc.DetectiveCases, list[list[list[dict]]]]:
    """An episode with a model responder whose reply to each chat is a function of the chat (a stand-in model:
    'reply <n>' numbering the suspect's questions so far), returning the chats of each round."""
    env = dc.DetectiveCases()
    env.reset(**row, responder="some/model")
    asked = []
    for responses in script:
        chats = env.ask(responses)
        asked.append(chats)
        env.step(responses, [f"reply {(len(c) - 2) // 2} of {c[0]['content'].split(chr(10))[2]}" for c in chats])
    return env, asked


def test_the_model_responder_chat_holds_only_the_suspects_own_card_and_memory():
    row = {"seed": 5}
    case = generate_case(5)
    script = [["Suspect: A\nQuestion: where were you?", "Suspect: B\nQuestion: motive?"],
              ["Suspect: A\nQuestion: and the weapon?", "Suspect: C\nQuestion: who did you see?"],
              ["Suspect: A\nQuestion: anything else?", "Suspect: B\nQuestion: and then?"]]
    env, asked = run_model_episode(row, script)
    a, b = env.case.names[0], env.case.names[1]
    last_a = asked[2][0]
    assert [m["role"] for m in last_a] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in last_a[1::2]] == ["where were you?", "and the weapon?", "anything else?"]
    assert last_a[2]["content"] == f"reply 0 of Your name: {a}"  # its own replies, in order
    assert [m["content"] for m in asked[2][1][1:]] == ["motive?", f"reply 0 of Your name: {b}", "and then?"]
    for chats in asked:
        for chat in chats:
            name = chat[0]["content"].split("\n")[2].removeprefix("Your name: ")
            text = "\n".join(m["content"] for m in chat)
            for card in case["suspects"]:
                if card["name"] != name:
                    for field in ("motive", "opportunity", "access_to_weapon", "evidence", "timeline"):
                        for line in dc.sentences(card.get(field)):
                            assert line not in text, (name, card["name"], field)
    assert env.memory[a][-1][:2] == ("anything else?", f"reply 2 of Your name: {a}")


def test_the_model_responder_step_needs_one_reply_per_chat():
    env = dc.DetectiveCases()
    env.reset(seed=3, responder="some/model")
    responses = ["Suspect: A\nQuestion: where?", "no turn here"]
    rules = dc.DetectiveCases()
    rules.reset(seed=3)
    assert len(env.ask(responses)) == 1 and rules.ask(responses) == []
    with pytest.raises(ValueError, match="step needs 1 replies"):
        env.step(responses, [])


def test_rules_answers_follow_each_role():
    case = dc.Case(generate_case(11))
    by_role = {r: n for n, r in case.roles.items()}
    ask = lambda role, q, memory=(): dc.rules_reply(case, by_role[role], q, list(memory))  # noqa: E731
    assert ask("murderer", "Did you have a motive?").startswith("I had no reason")
    assert ask("murderer", "Who do you suspect?").startswith(f"I saw {case.scapegoat}")
    assert case.murderer in ask("accomplice", "Who did you see?") and "could not have done it" in ask(
        "accomplice", "Who did you see?")
    assert ask("nervous", "Who did you see?") in dc.NERVOUS_ASIDES
    again = ask("nervous", "Who did you see?", [("Who did you see?", "aside", "testimony")])
    assert f"saw {case.murderer}" in again
    assert f"saw {case.murderer}" in ask("helper", "Did you see anyone?")
    assert ask("uninformed", "Where were you?") in dc.UNINFORMED_LINES
    assert dc.intent_of("Where were you at nine?", "brass candlestick") == "whereabouts"
    assert dc.intent_of("Did you ever touch the candlestick?", "brass candlestick") == "weapon"
    assert dc.intent_of("Where were you at the time of the murder?", "x") == "whereabouts"
    assert dc.intent_of("Did you kill the victim?", "x") == "guilt"
    denials = {ask(role, "Did you kill the victim?") for role in ("murderer", "helper", "accomplice")}
    assert denials == {f"No. I did not kill {case.victim}."}  # a direct question tells the murderer from no one


def test_a_row_that_is_neither_a_case_nor_a_seed_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^a detective-cases row needs AR-Bench's columns \(victim, suspects, "
                                         r"initial_information, label\) or a seed; this row lacks suspects, "
                                         r"initial_information, label \(columns: problem, victim\)$"):
        dc.DetectiveCases().reset(problem="1+1", victim={"name": "x"})
    with pytest.raises(ValueError, match="this row lacks victim, suspects, initial_information, label"):
        dc.DetectiveCases().reset(problem="1+1")
    case = generate_case(0)
    case["suspects"][0]["is_murderer"] = False
    case["suspects"][0].pop("role")
    with pytest.raises(ValueError, match="^a detective case needs exactly one suspect with is_murderer true, found 0"):
        dc.DetectiveCases().reset(**case)


def test_an_honest_witness_whose_card_saw_someone_else_tells_what_was_seen_of_the_murderer():
    case_row = json.loads(FIXTURE.read_text())[0]
    helper = case_row["suspects"][1]
    helper["testimony"] = [f"{helper['name']} saw Tomas Greer by the gate."]  # about someone else
    case = dc.Case(case_row)
    reply = dc.rules_reply(case, helper["name"], "Did you see anyone?", [])
    suspicion = case_row["suspects"][0]["suspicion"][0]
    assert reply == f"I saw {case.murderer} that day, and this is what struck me: {suspicion}"
    nervous = case_row["suspects"][3]["name"]  # its card names the murderer: told as written, in its voice
    again = dc.rules_reply(case, nervous, "Who did you see?", [("Who did you see?", "aside", "testimony")])
    assert again == "I... all right. I saw Ines Moreau near the victim's tea tray at 10:25 PM."


def test_roles_are_read_from_arbench_cards_also_when_a_table_reader_filled_missing_fields_with_none():
    suspects = json.loads(FIXTURE.read_text())[1]["suspects"]
    fields = {k for card in suspects for k in card}
    filled = [{k: card.get(k) for k in fields} for card in suspects]  # what datasets/pyarrow give for a ragged list
    assert list(roles_of(filled).values()) == ["murderer", "helper", "accomplice", "nervous", "uninformed"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.text(max_size=60), st.builds(
    lambda s, q: f"Suspect: {s}\nQuestion: {q}", st.sampled_from(["A", "e", "Z", "Thorne", ""]), st.text(max_size=30))),
    min_size=1, max_size=3), min_size=1, max_size=12), st.integers(0, 10_000))
def test_any_responses_give_one_chat_per_parsed_turn_and_an_episode_that_ends(rounds, seed):
    rules, model = dc.DetectiveCases(), dc.DetectiveCases()
    rules.reset(seed=seed, turns=6)
    model.reset(seed=seed, turns=6, responder="some/model")
    done = False
    for responses in rounds:
        chats = model.ask(responses)
        expected = 0 if model.answering else sum(t is not None for _, t in model.turns_of(responses))
        assert len(chats) == expected and all(c[-1]["role"] == "user" for c in chats)
        obs, done = rules.step(responses)
        model.step(responses, ["I was in the garden."] * len(chats))
        assert isinstance(obs, str) and rules.get_reward() in (0.0, 1.0)
        if done:
            break
    assert done or len(rounds) < 7  # each round spends a turn: 6 question rounds at most, then the answer


def test_a_model_suspects_reply_is_kept_to_its_first_line():
    env = dc.DetectiveCases()
    env.reset(seed=2, responder="some/model")
    obs, _ = env.step(["Suspect: A\nQuestion: where?"], ["\n  I was in the garden.\nI was in the garden.\n"])
    assert obs.endswith(": I was in the garden.") and env.memory[env.case.names[0]][0][1] == "I was in the garden."
    assert dc.first_line("x" * 400) == "x" * 300 and dc.first_line(" \n") == "..."


@pytest.mark.slow
def test_sat_trains_a_tiny_team_on_detective_cases_and_situation_puzzles_with_the_rules_responder(tmp_path):
    """One stage of sat.py per game (tiny x2, two questions, three rounds): the rules responder needs nothing
    from the harness beyond the contract's ``step(responses)``."""
    from harness.cli import main

    small = ["--agents", "tiny x2", "--batch-size", "4", "--group-size", "2", "--epochs", "1", "--minibatch-size",
             "4", "--eval-size", "2", "--warmup-steps", "0", "--max-new-tokens", "3", "--max-rounds", "3"]
    for task in ("env:detective-cases", "env:situation-puzzles"):
        out = tmp_path / task[4:]
        assert main(small + ["--task", task, "--task-option", "turns=2", "--stages", "1", "--out", str(out)]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert rows[1]["episode_rounds"] == 2.0  # two agents spend the two turns in round 1; round 2 answers
        sample = json.loads((out / "samples.jsonl").read_text().splitlines()[-1])
        assert "The team's answer" in sample["transcript"]


def test_a_case_whose_label_or_lists_disagree_with_its_cards_is_refused_in_one_line():
    case = json.loads(FIXTURE.read_text())[0]
    wrong = {**case, "label": (case["label"] + 1) % 5}
    with pytest.raises(ValueError, match=r"^a detective case's label 3 names Pavel Sand, but the card with "
                                         r"is_murderer true is Ines Moreau; label is the murderer's index"):
        dc.DetectiveCases().reset(**wrong)
    short = {**case, "initial_information": {**case["initial_information"],
                                             "suspect": case["initial_information"]["suspect"][:4]}}
    with pytest.raises(ValueError, match="^a detective case lists 4 suspects in initial_information.suspect"):
        dc.DetectiveCases().reset(**short)


def test_a_model_responder_episode_replays_exactly_and_ask_changes_nothing():
    script = [["Suspect: A\nQuestion: where were you?", "Suspect: B\nQuestion: motive?"],
              ["Suspect: A\nQuestion: the weapon?", "bad turn"], ["Answer: B", "Answer: A"]]

    def run() -> list:
        env = dc.DetectiveCases()
        seen = [env.reset(seed=21, turns=4, responder="some/model")]
        for responses in script:
            chats = env.ask(responses)
            assert env.ask(responses) == chats  # ask is pure: the harness may call it, then step
            obs, done = env.step(responses, [f"reply to {c[-1]['content']}" for c in chats])
            seen += [chats, obs, done]
        return seen + [env.get_reward()]

    first = run()
    assert first == run() and first[-2] is True
