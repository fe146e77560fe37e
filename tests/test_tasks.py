"""Tests for harness/tasks.py and harness/math_grading.py: synthetic task, loaders, answer extraction and reward."""

import random
import sys
import types
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import math_grading  # noqa: E402
from harness.math_grading import answers_match, extract_answer, grade, majority_vote, normalize_answer  # noqa: E402
from harness.tasks import (  # noqa: E402
    DATASETS,
    DIFFICULTY_RANGES,
    Problem,
    arithmetic_problems,
    canonical_dataset_name,
    is_heldout_pair,
    load_dataset_by_name,
    load_jsonl,
    load_problem_set,
    noisy_label,
    row_to_problem,
    rows_to_problems,
)

DATA = Path(__file__).resolve().parents[1] / "data"

# ---------------------------------------------------------------------------
# Equivalence table: (prediction, gold, expected). A prediction containing
# \boxed is a response and goes through extract_answer first.
# ---------------------------------------------------------------------------

CASES = [
    # integers, AIME style
    ("33", "33", True),
    ("033", "33", True),
    ("\\boxed{204}", "204", True),
    ("The answer is \\boxed{033}.", "33", True),
    ("33", "333", False),
    ("-5", "5", False),
    ("\\boxed{12}", "21", False),
    ("+7", "7", True),
    ("1,000", "1000", True),
    ("1{,}000", "1000", True),
    ("1\\,000", "1000", True),
    ("1,000", "100", False),
    ("5.0", "5", True),
    ("5.", "5", True),
    ("5.01", "5", False),
    # fractions and decimals
    ("3/4", "\\frac{3}{4}", True),
    ("\\dfrac34", "3/4", True),
    ("\\tfrac{3}{4}", "0.75", True),
    ("0.75", "\\frac{3}{4}", True),
    ("0.50", "0.5", True),
    ("0.5", "1/2", True),
    ("1/2", "2", False),
    ("\\frac{1}{2}", "\\frac{2}{1}", False),
    ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{1}{2}", "-0.5", False),
    ("\\frac{2}{4}", "\\frac{1}{2}", True),
    # wrappers and formatting
    ("$42$", "42", True),
    ("\\(42\\)", "42", True),
    ("\\text{42}", "42", True),
    ("42.", "42", True),
    ("3\\!000", "3000", True),
    ("\\left( 1, 2 \\right)", "(1,2)", True),
    ("(1,2)", "(2,1)", False),
    # units, degrees, percent, currency
    ("5 cm", "5", True),
    ("\\text{5 cm}", "5", True),
    ("30^\\circ", "30", True),
    ("30^{\\circ}", "30", True),
    ("30 degrees", "30", True),
    ("50\\%", "50", True),
    ("\\$5", "5", True),
    ("31^\\circ", "30", False),
    # equations
    ("x = 5", "5", True),
    ("x=5", "x=5", True),
    ("x = 6", "5", False),
    # symbolic
    ("\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt2}{2}", True),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
    ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("\\sqrt{3}", "\\sqrt{2}", False),
    ("\\pi", "3.14159", False),
    # numeric near-misses: an exact answer must be given exactly
    ("0.333333", "\\frac{1}{3}", False),
    ("33.0000001", "33", False),
    ("0.5", "50\\%", False),
    # nothing to grade
    ("", "5", False),
    ("\\boxed{}", "5", False),
    # responses (issue 13): truncation, currency, self-corrections
    ("so it is \\boxed{17", "17", False),  # unterminated box: truncated, never right
    ("\\boxed{17", "17", False),
    ("The answer is $\\$18.90$.", "18.90", True),  # escaped dollar inside math
    ("The answer is $18.90.", "18.9", True),  # a currency sign
    ("The answer is 12. Wait, actually 13.", "13", False),  # self-correction: no answer
    ("The answer is 12. Wait, actually 13.", "12", False),
    ("The answer is \\boxed{12}. Wait, actually 13.", "12", True),  # a closed box is the final answer
]

# Where a single backend disagrees with the table, by design or by limitation.
# These run as strict xfails, so a change in either backend shows up.
KNOWN_DIFFERENCES = {
    ("builtin", "\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt2}{2}"): "builtin does no symbolic algebra",
    ("builtin", "\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"): "builtin does no symbolic algebra",
    ("builtin", "2\\sqrt{3}", "\\sqrt{12}"): "builtin does no symbolic algebra",
    ("math_verify", "1\\,000", "1000"): "math-verify reads '1\\,000' as 1*0 (thin space not a separator)",
    ("math_verify", "\\text{5 cm}", "5"): "math-verify keeps \\text{5 cm} as a string",
    ("math_verify", "0.333333", "\\frac{1}{3}"): "math-verify rounds floats to 6 places",
    ("math_verify", "0.5", "50\\%"): "math-verify treats 50\\% as 1/2",
}


def _table_params(backend):
    params = []
    for pred, gold, expected in CASES:
        reason = KNOWN_DIFFERENCES.get((backend, pred, gold))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(pred, gold, expected, marks=marks, id=f"{pred}|{gold}"))
    return params


def _as_answer(pred):
    """A response (it has a box or an answer phrase) goes through extraction, math-benchmark rule."""
    return extract_answer(pred, final_only=True) if "\\boxed" in pred or "answer is" in pred else pred


def test_table_is_big_and_consistent():
    assert len(CASES) >= 40
    assert sum(not e for _, _, e in CASES) >= 10
    table_keys = {(p, g) for p, g, _ in CASES}
    assert all((p, g) in table_keys for _, p, g in KNOWN_DIFFERENCES)


@pytest.mark.parametrize("pred,gold,expected", _table_params("builtin"))
def test_table_builtin(pred, gold, expected):
    assert answers_match(_as_answer(pred), gold, backend="builtin") is expected


@pytest.mark.skipif(not math_grading.math_verify_available(), reason="math-verify not installed")
@pytest.mark.parametrize("pred,gold,expected", _table_params("math_verify"))
def test_table_math_verify(pred, gold, expected):
    assert answers_match(_as_answer(pred), gold, backend="math_verify") is expected


@pytest.mark.parametrize("pred,gold,expected", _table_params("auto"))
def test_table_auto(pred, gold, expected):
    """The default combines both and gets the whole table right."""
    if not math_grading.math_verify_available() and any(k[1:] == (pred, gold) for k in KNOWN_DIFFERENCES
                                                 if k[0] == "builtin"):
        pytest.skip("needs math-verify for symbolic equivalence")
    assert answers_match(_as_answer(pred), gold) is expected


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        answers_match("1", "1", backend="sympy")


def test_none_never_matches():
    for backend in ("builtin", "auto", "math_verify"):
        assert answers_match(None, "5", backend=backend) is False


def test_math_verify_off_main_thread():
    """math-verify's signal-based timeout must not crash grading in a worker thread."""
    import threading
    if not math_grading.math_verify_available():
        pytest.skip("math-verify not installed")
    out = {}
    t = threading.Thread(target=lambda: out.update(
        ok=answers_match("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", backend="math_verify"),
        bad=answers_match("\\sqrt{3}", "\\sqrt{2}", backend="math_verify")))
    t.start()
    t.join(30)
    assert out == {"ok": True, "bad": False}


@settings(max_examples=200, deadline=None)
@given(st.fractions(min_value=-1000, max_value=1000, max_denominator=50))
def test_fraction_forms_agree(x):
    latex = f"\\frac{{{x.numerator}}}{{{x.denominator}}}"
    assert answers_match(latex, f"{x.numerator}/{x.denominator}", backend="builtin")
    assert Fraction(normalize_answer(latex)) == x
    assert not answers_match(latex, f"{x + 1}", backend="builtin")


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=999))
def test_aime_integers(n):
    assert answers_match(f"{n:03d}", str(n))
    assert answers_match(f"{n:,}", str(n))
    assert not answers_match(str(n), str(n + 1))


# ---------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{\\left(\\frac{a}{b}, {c}\\right)}", "\\left(\\frac{a}{b}, {c}\\right)"),
    ("first \\boxed{1}, then \\boxed{2}", "2"),
    ("\\fbox{9}", "9"),
    ("$\\boxed 5$", "5"),
    ("\\boxed{3} and a truncated \\boxed{4", None),  # cut inside its final answer: none (3 may be what it corrects)
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not grouping
    ("The final answer is $\\frac{3}{4}$. I hope it is correct.", "\\frac{3}{4}"),
    ("so the final answer is 12. Done", "12"),
    ("blah\nAnswer: 17\n", "17"),
    ("we get 3/4 and then -2.5", "-2.5"),
    ("the total is 1,000 apples", "1,000"),
    ("x-5 leaves 5", "5"),
    ("no numbers here", None),
    ("", None),
])
def test_extract(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text,lenient,final", [
    ("\\boxed{17", None, None),  # truncated inside the answer
    ("we computed 17 and then", "17", None),  # a number mid-sentence is no final answer on math benchmarks
    ("17", "17", None),  # the synthetic task's bare answer counts only without final_only
    ("The answer is 12. Wait, actually 13.", None, None),  # self-corrected phrase: no answer in either mode
    ("The answer is 12.", "12", "12"),
    ("The answer is $\\$18.90$.", "\\$18.90", "\\$18.90"),
    ("<think>\\boxed{7}</think>so \\boxed{8", None, None),  # cut after thinking, inside the box: not 7
])
def test_extract_final_only_and_truncation(text, lenient, final):
    assert extract_answer(text) == lenient
    assert extract_answer(text, final_only=True) == final


def test_team_extract_uses_the_final_answer_rule_for_boxed_instructions():
    from harness.math_grading import math_team_config
    from harness.tasks import BOXED_INSTRUCTION
    from team import Team

    boxed = Team([object()], math_team_config(instruction=BOXED_INSTRUCTION))
    bare = Team([object()], math_team_config(instruction=""))
    assert boxed.extract("so 17") is None and bare.extract("so 17") == "17"
    assert boxed.extract("\\boxed{17") is None and bare.extract("\\boxed{17") is None


def test_extract_think_block():
    # Thinking is ignored when the visible part has an answer...
    assert extract_answer("<think>maybe \\boxed{7}</think>It is \\boxed{8}") == "8"
    assert extract_answer("<think>try 7</think>The answer is 8.") == "8"
    # ...and used as a fallback when it does not (e.g. a response cut after </think>).
    assert extract_answer("<think>so \\boxed{7}</think>") == "7"


def test_grade():
    assert grade("<think>hmm</think> \\boxed{033}", "33") == ("033", True)
    assert grade("I think it's \\boxed{204}", "204") == ("204", True)
    assert grade("nothing", "1") == (None, False)
    assert grade("23+15=38", "38") == ("38", True)  # the arithmetic task's bare style


# ---------------------------------------------------------------------------
# Majority vote
# ---------------------------------------------------------------------------

def test_majority_vote():
    assert majority_vote(["5", "6", "6", None]) == "6"
    assert majority_vote(["1/2", "0.5", "3"]) == "1/2"  # normalised before counting
    assert majority_vote(["05", "5", "7"]) == "05"  # the first occurrence's spelling
    assert majority_vote([None, "", None]) is None
    assert majority_vote([]) is None


def test_majority_vote_ties_go_to_the_earliest_agent():
    assert majority_vote(["5", "6"]) == "5"
    assert majority_vote(["6", "5", "5", "6"]) == "6"
    assert majority_vote([None, "7", "8", "8", "7"]) == "7"
    assert majority_vote(["1", "2", "3"]) == "1"


# ---------------------------------------------------------------------------
# Synthetic task
# ---------------------------------------------------------------------------

def test_arithmetic_deterministic_and_format():
    a = arithmetic_problems(50, seed=3)
    assert a == arithmetic_problems(50, seed=3)
    assert a != arithmetic_problems(50, seed=4)
    for p in a:
        x, y = map(int, p.problem.split("+"))
        assert p.problem == f"{x}+{y}" and p.answer == str(x + y)
        assert p.id == f"arith-d1-{x}+{y}"
    assert len({p.id for p in a}) == 50  # no repeats while n fits in the split


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTY_RANGES))
def test_arithmetic_ranges(difficulty):
    (a_lo, a_hi), (b_lo, b_hi) = DIFFICULTY_RANGES[difficulty]
    for split in ("train", "heldout"):
        for p in arithmetic_problems(300, seed=0, difficulty=difficulty, split=split):
            x, y = map(int, p.problem.split("+"))
            assert a_lo <= x <= a_hi and b_lo <= y <= b_hi
            assert is_heldout_pair(x, y) == (split == "heldout")
    assert DIFFICULTY_RANGES[1] == ((10, 49), (10, 19))


def test_split_partitions_the_whole_difficulty1_space():
    """Every pair is in exactly one split, for every seed: drawing more than the
    split size covers the split, and the two covers are disjoint and complete."""
    train = {p.problem for seed in (0, 1) for p in arithmetic_problems(400, seed, 1, "train")}
    held = {p.problem for seed in (0, 1) for p in arithmetic_problems(400, seed, 1, "heldout")}
    everything = {f"{a}+{b}" for a in range(10, 50) for b in range(10, 20)}
    assert train.isdisjoint(held)
    assert train | held == everything
    assert 0.1 < len(held) / len(everything) < 0.3


def test_arithmetic_repeats_when_n_exceeds_split():
    held = arithmetic_problems(200, seed=0, split="heldout")
    assert len(held) == 200
    assert len({p.id for p in held}) == 200  # repeats carry a -r<k> suffix
    assert len({p.problem for p in held}) < 200


def test_arithmetic_bad_args():
    with pytest.raises(ValueError, match="difficulty"):
        arithmetic_problems(1, 0, difficulty=9)
    with pytest.raises(ValueError, match="split"):
        arithmetic_problems(1, 0, split="test")


def test_noisy_label():
    rng = random.Random(0)
    n, wrong = 20000, 0
    for _ in range(n):
        label = noisy_label("38", rng, p_wrong=0.5)
        if label != "38":
            wrong += 1
            assert int(label) - 38 in (-10, -2, -1, 1, 2, 10)
    assert abs(wrong / n - 0.5) < 0.02
    assert all(noisy_label("38", rng, p_wrong=0.0) == "38" for _ in range(100))
    assert all(noisy_label("38", rng, p_wrong=1.0) != "38" for _ in range(100))
    small = {noisy_label("1", rng, p_wrong=1.0) for _ in range(500)}
    assert small == {"0", "2", "3", "11"}  # never negative, never the right answer


# ---------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------

def test_load_jsonl_good(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"id": "q1", "problem": "1+1?", "answer": 2}\n\n'
                 '{"prompt": "2+2?", "answer": "4"}\n'
                 '{"problem": "half?", "answer": 0.5}\n')
    probs = load_jsonl(f)
    assert probs == [Problem("q1", "1+1?", "2"), Problem("mine-3", "2+2?", "4"), Problem("mine-4", "half?", "0.5")]
    assert [(p.problem, p.answer) for p in load_problem_set(str(f))] == [(p.problem, p.answer) for p in probs]


def test_load_jsonl_bad_json(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text('{"problem": "a", "answer": 1}\n\n{"problem": "b" "answer": 2}\n')
    with pytest.raises(ValueError) as e:
        load_jsonl(f)
    msg = str(e.value)
    assert "data.jsonl:3:" in msg and "not valid JSON" in msg
    assert '"problem" and "answer"' in msg and "\n" not in msg


@pytest.mark.parametrize("line,needle", [
    ('{"problem": "a"}', 'missing "answer"'),
    ('{"answer": 1}', 'missing "problem"'),
    ('[1, 2]', "expected a JSON object"),
    ('{"problem": "a", "answer": null}', '"answer" must be'),
    ('{"problem": "", "answer": 1}', "empty"),
])
def test_load_jsonl_bad_fields(tmp_path, line, needle):
    f = tmp_path / "x.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ValueError, match="x.jsonl:1:") as e:
        load_jsonl(f)
    assert needle in str(e.value)


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError):
        load_problem_set(str(tmp_path / "nope.jsonl"))


def test_bundled_data():
    aime24 = load_problem_set(str(DATA / "aime24.jsonl"))
    assert len(aime24) == 30 and len({p.id for p in aime24}) == 30
    assert aime24[0].answer == "204"
    assert len(load_jsonl(DATA / "aime25.jsonl")) == 30
    assert len(load_jsonl(DATA / "math500.jsonl")) == 500


# ---------------------------------------------------------------------------
# Datasets by name (no network)
# ---------------------------------------------------------------------------

def test_dataset_table():
    assert canonical_dataset_name("AIME2024") == "aime24"
    assert canonical_dataset_name("aime_2025") == "aime25"
    assert canonical_dataset_name("DAPO-Math-17k") == "dapo-math-17k"
    assert canonical_dataset_name("MATH-500") == "math500"
    assert DATASETS["dapo-math-17k"].hub_id == "BytedTsinghua-SIA/DAPO-Math-17k"
    assert DATASETS["dapo-math-17k"].answer_field == "reward_model.ground_truth"
    assert DATASETS["aime24"].hub_id == "HuggingFaceH4/aime_2024"
    assert DATASETS["aime25"].hub_id == "opencompass/AIME2025"
    assert DATASETS["aime25"].configs == ("AIME2025-I", "AIME2025-II")
    assert DATASETS["aime25"].problem_field == "question"
    assert DATASETS["math500"].hub_id == "HuggingFaceH4/MATH-500"
    assert DATASETS["deepscaler"].hub_id == "agentica-org/DeepScaleR-Preview-Dataset"


def test_unknown_dataset_name():
    with pytest.raises(ValueError) as e:
        load_dataset_by_name("gsm9k")
    assert "aime24" in str(e.value) and "JSONL" in str(e.value)


DAPO_ROW = {
    "data_source": "math_dapo",
    "prompt": [{"role": "user", "content":
                "Solve the following math problem step by step. The last line of your response should be "
                "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
                "\n\nFind $x$ if $x+1=3$.\n\nRemember to put your answer on its own line after \"Answer:\"."}],
    "ability": "MATH",
    "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "abc-123"},
}


@pytest.mark.parametrize("name,row,expected", [
    ("dapo-math-17k", DAPO_ROW, Problem("abc-123", "Find $x$ if $x+1=3$.", "2")),
    ("aime24", {"id": 60, "problem": "P?", "solution": "...", "answer": "204", "url": "u", "year": "2024"},
     Problem("60", "P?", "204")),
    ("aime25", {"question": "Q?", "answer": "70"}, Problem("fallback", "Q?", "70")),
    ("math500", {"problem": "M?", "solution": "s", "answer": "\\frac{1}{2}", "subject": "Algebra",
                 "level": 2, "unique_id": "test/algebra/1.json"}, Problem("test/algebra/1.json", "M?", "\\frac{1}{2}")),
    ("deepscaler", {"problem": "D?", "answer": "3", "solution": "s"}, Problem("fallback", "D?", "3")),
])
def test_row_to_problem(name, row, expected):
    assert row_to_problem(row, DATASETS[name], "fallback") == expected


def test_row_to_problem_unusable_rows():
    spec = DATASETS["dapo-math-17k"]
    assert row_to_problem({"prompt": [], "reward_model": {"ground_truth": "1"}}, spec, "f") is None
    assert row_to_problem({"prompt": [{"role": "user", "content": "x"}]}, spec, "f") is None


def test_rows_to_problems_dedupes_dapo():
    rows = [DAPO_ROW, DAPO_ROW, {**DAPO_ROW, "extra_info": {"index": "z"}, "reward_model": {"ground_truth": "9"},
                                 "prompt": [{"role": "user", "content": "Other?"}]}]
    probs = rows_to_problems(rows, DATASETS["dapo-math-17k"], "dapo")
    assert [p.id for p in probs] == ["abc-123", "z"]
    assert len(rows_to_problems(rows, DATASETS["dapo-math-17k"], "dapo", limit=1)) == 1


def test_load_by_name_with_stub_datasets(monkeypatch):
    """The download path, with `datasets` replaced by a stub: configs are concatenated."""
    calls = []

    def load_dataset(hub_id, config, split):
        calls.append((hub_id, config, split))
        return [{"question": f"{config} q{i}", "answer": str(i)} for i in range(15)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    probs = load_dataset_by_name("AIME2025")
    assert len(probs) == 30
    assert calls == [("opencompass/AIME2025", "AIME2025-I", "test"), ("opencompass/AIME2025", "AIME2025-II", "test")]
    assert len(set(p.id for p in probs)) == 30
    assert len(load_dataset_by_name("aime25", limit=5)) == 5


def test_offline_error_is_clear(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The flags are read when the libraries are imported; patch them if that already happened.
    if "datasets" in sys.modules:
        monkeypatch.setattr(sys.modules["datasets"].config, "HF_HUB_OFFLINE", True, raising=False)
        monkeypatch.setattr(sys.modules["datasets"].config, "HF_DATASETS_OFFLINE", True, raising=False)
    if "huggingface_hub" in sys.modules:
        monkeypatch.setattr(sys.modules["huggingface_hub"].constants, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_HOME", "/nonexistent-sat-test-cache")  # no cached copy to fall back on
    with pytest.raises(RuntimeError) as e:
        load_dataset_by_name("aime24")
    msg = str(e.value)
    assert "\n" not in msg
    assert "HuggingFaceH4/aime_2024" in msg and "--data path/to.jsonl" in msg and "data/" in msg


# ---------------------------------------------------------------------------
# arithmetic-chat: the synthetic task phrased for chat models
# ---------------------------------------------------------------------------
def _chat_fact(p):
    """(a, op, b) of an arithmetic-chat problem, read back from its text "a op b = ?"."""
    a, op, b, eq, q = p.problem.split(" ")
    assert (eq, q) == ("=", "?") and op in "+-*"
    return int(a), op, int(b)


def test_chat_arithmetic_is_deterministic_and_its_answers_are_right():
    from harness.tasks import CHAT_KINDS, chat_arithmetic_problems

    kinds = tuple(CHAT_KINDS)
    a = chat_arithmetic_problems(300, seed=3, kinds=kinds)
    assert a == chat_arithmetic_problems(300, seed=3, kinds=kinds)
    assert a != chat_arithmetic_problems(300, seed=4, kinds=kinds)
    assert len({p.id for p in a}) == 300
    for i, p in enumerate(a):
        x, op, y = _chat_fact(p)
        kind = kinds[i % len(kinds)]  # the kinds in turn
        assert p.id.startswith(f"chat-{kind}-{x}{op}{y}")
        want_op, (a_lo, a_hi), (b_lo, b_hi) = CHAT_KINDS[kind]
        assert op == want_op and a_lo <= x <= a_hi and b_lo <= y <= b_hi
        assert p.answer == str(x + y if op == "+" else x - y if op == "-" else x * y)
        assert int(p.answer) >= 0
    mul1 = chat_arithmetic_problems(200, seed=0, split="heldout", kinds=("mul1",))  # 10 facts: reshuffled repeats
    assert len({p.id for p in mul1}) == 200 and any(p.id.endswith("-r1") for p in mul1)


def test_chat_arithmetic_train_and_heldout_do_not_overlap():
    from harness.tasks import CHAT_KINDS, CHAT_MIX, chat_arithmetic_problems, is_heldout_fact

    def facts(split, kind):  # as one fact: 3*4 is 4*3
        return {(min(x, y), op, max(x, y)) if op in "+*" else (x, op, y)
                for seed in (0, 1) for x, op, y in map(_chat_fact, chat_arithmetic_problems(200, seed, split, (kind,)))}

    for kind in ("add1", "sub1", "mul1"):  # small kinds: 200 draws cover each split
        train, held = facts("train", kind), facts("heldout", kind)
        assert train and held and not train & held
        assert all(is_heldout_fact(*f) for f in held) and not any(is_heldout_fact(*f) for f in train)
    assert set(CHAT_MIX) <= set(CHAT_KINDS)
    with pytest.raises(ValueError, match="kind must be one of"):
        chat_arithmetic_problems(1, 0, kinds=("div1",))
    with pytest.raises(ValueError, match="split must be"):
        chat_arithmetic_problems(1, 0, split="test")


def test_load_task_arithmetic_chat_asks_for_a_boxed_answer():
    from harness.config import Config
    from harness.math_grading import math_team_config
    from harness.tasks import CHAT_MIX, is_heldout_fact, load_task
    from team import Team

    cfg = Config(agents="tiny x3", task="arithmetic-chat", eval_size=64, device="cpu").apply_preset()
    train, held, instruction = load_task(cfg)
    assert "\\boxed{" in instruction and len(held) == 64
    assert {p.id.split("-")[1] for p in train} == set(CHAT_MIX)
    assert not any(is_heldout_fact(*_chat_fact(p)) for p in train) and all(is_heldout_fact(*_chat_fact(p))
                                                                           for p in held)
    assert load_task(cfg) == (train, held, instruction)
    team = Team([object()], math_team_config(instruction=instruction))
    assert team.user_message(train[0], []) == train[0].problem + instruction
    # graded as the run grades: the last complete box (or "answer is X"); a bare equation does not count
    right = {"7 * 8 = 56\n\nThe answer is \\boxed{56}.": True, "\\boxed{56}": True, "The answer is 56.": True,
             "\\boxed{55}": False, "7 * 8 = 56\n\nThe answer is \\boxed{answer}.": False, "\\boxed{5": False,
             "7 * 8 = 56": False}
    for text, ok in right.items():
        assert answers_match(team.extract(text), "56") is ok, text
    arith = Config(agents="tiny x3", device="cpu").apply_preset()  # the tiny agents' task is unchanged
    assert load_task(arith)[2] == "" and load_task(arith)[0][0].problem.count("+") == 1
