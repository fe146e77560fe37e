"""An environment that owns its rows: the data holds an id and a secret number, no ``problem`` and no ``answer``.
The opening comes from ``reset`` and the reward from ``get_reward``, so neither column would mean anything.

    python sat.py --agents "SmolLM2-135M x2" --env examples/number_game_env.py:NumberGuess \\
        --data examples/number_game.jsonl --eval-data examples/number_game_heldout.jsonl

Each row reaches ``reset`` as keywords (here ``id`` and ``secret``); the row's id keys its seeds and the pairing of
held-out evaluations, as any row's does. Written to the README's contract only.
"""
import re

LOW, HIGH = 1, 20  # the secret is a whole number in [LOW, HIGH]


def first_number(text: str) -> int | None:
    """The first whole number written in a response, else None."""
    found = re.search(r"-?\d+", text)
    return int(found.group()) if found else None


class NumberGuess:
    """Guess the secret in up to three rounds, told after each round whether each guess is too high or too low.
    Reward: 1 once a guess is right, else 0."""

    max_rounds = 3
    reward_range = (0.0, 1.0)

    def reset(self, secret, **row) -> str:
        self.secret, self.solved = int(secret), False
        return (f"I am thinking of a whole number from {LOW} to {HIGH}. Each of you says one number; after each "
                "round I tell you whether each guess is too high or too low.")

    def step(self, responses: list[str]) -> tuple[str, bool]:
        lines = []
        for k, text in enumerate(responses):
            guess = first_number(text)
            if guess is None:
                lines.append(f"Agent {k + 1}: Say a number.")
                continue
            self.solved = self.solved or guess == self.secret
            verdict = "right" if guess == self.secret else "too high" if guess > self.secret else "too low"
            lines.append(f"Agent {k + 1}: {guess} is {verdict}.")
        return "\n".join(lines), self.solved

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0
