"""An example team reward for your own task: copy this file and change ``reward``.

    python sat.py --data examples/addition.jsonl --eval-data examples/addition_heldout.jsonl \\
        --reward examples/addition_reward.py:reward

The contract (harness/user_reward.py probes it on the data's first rows before any model loads, and checks every
call after that):
  - ``prompts[i]`` is row i's problem, ``completions[i][k]`` agent k's response in joint trajectory i;
  - every other column of your data file arrives by keyword, one value per row (here ``answer``), with
    ``agent_answers`` (each agent's extracted answer) and ``protocol`` ("independent" or "chain");
  - one number per row in [0, 1] (or in ``reward.reward_range = (lo, hi)`` if you set one);
  - the same number for the same row, whatever else is in the batch: SAT calls it again on swapped and
    redrawn outputs (the counterfactual baseline and the paired certificates).
"""


def parse_int(text: str) -> int | None:
    """The response as a whole number ("38", " 38 "), else None."""
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else None


def reward(prompts: list[str], completions: list[list[str]], answer: list[int], **columns) -> list[float]:
    """The share of the team's agents whose response is the right sum: a joint reward with partial credit, so a
    team in which one agent is right already earns something to learn from."""
    return [sum(parse_int(text) == int(gold) for text in texts) / len(texts)
            for texts, gold in zip(completions, answer)]
