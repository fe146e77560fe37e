"""An example environment: the team guesses a sum and is told, after each round, whether each guess is too high or
too low. Copy this file and change the class.

    python sat.py --data examples/addition.jsonl --eval-data examples/addition_heldout.jsonl \\
        --env examples/addition_env.py:AdditionGame

The contract (harness/environments.py checks it and plays the data's first rows twice before any model loads):
  - a constructor with no arguments: one object per joint trajectory;
  - ``reset(**row) -> str``: the opening observation, from the data row's columns (``problem``, ``answer``, ...);
  - ``step(responses) -> (observation, done)``: the round's responses, one per agent in order;
  - ``get_reward() -> float``: the episode's team reward, read when it ends (in ``reward_range``, [0, 1] by default);
  - ``max_rounds``: the most rounds an episode runs (``--max-rounds`` overrides it);
  - deterministic: the same row and the same responses give the same observations and reward.
"""


def parse_int(text: str) -> int | None:
    """The response as a whole number ("38", " 38 "), else None."""
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else None


class AdditionGame:
    """Guess the sum in up to three rounds. Reward: 1 once a guess is right; else half of the closest guess's
    1 / (1 + |guess - sum|), so a near miss earns something to learn from."""

    max_rounds = 3
    reward_range = (0.0, 1.0)

    def reset(self, problem: str, answer, **columns) -> str:
        self.gold, self.best, self.solved = int(answer), 0.0, False
        return problem

    def step(self, responses: list[str]) -> tuple[str, bool]:
        lines = []
        for k, text in enumerate(responses):
            guess = parse_int(text)
            if guess is None:
                lines.append(f"Agent {k + 1}: not a number")
                continue
            self.solved = self.solved or guess == self.gold
            self.best = max(self.best, 1 / (1 + abs(guess - self.gold)))
            verdict = "right" if guess == self.gold else "too high" if guess > self.gold else "too low"
            lines.append(f"Agent {k + 1}: {guess} is {verdict}")
        return "\n".join(lines), self.solved

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.5 * self.best
