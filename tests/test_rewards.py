"""Reward components and their checks (exactga.grpo.rewards): what each reward gives a completion,
how the weighted total and the successes come out, and bad rewards or configs named."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from exactga.grpo.rewards import (
    CharacterShare,
    CorrectAnswer,
    DigitFormat,
    Reward,
    build_rewards,
    check_rewards,
    first_number,
    reward_name,
    score_completions,
    successes,
)


def scores(component, completions: list[str], answer: str = "7") -> list[float]:
    n = len(completions)
    return component(["3 + 4 ="] * n, completions, [answer] * n).tolist()


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" 7", 1.0),
        ("7", 1.0),
        ("7 apples, not 8", 1.0),
        ("so it is 7.", 1.0),  # the sentence's full stop is no decimal point
        ("07", 1.0),
        ("7.0", 1.0),
        ("8", 0.0),
        ("77", 0.0),  # a digit too many is another number
        ("-7", 0.0),
        ("3 then 7", 0.0),  # the first number counts
        ("seven", 0.0),
        ("", 0.0),
    ],
)
def test_correct_answer_reads_the_first_number(completion, expected):
    assert scores(CorrectAnswer(), [completion]) == [expected]


def test_correct_answer_refuses_an_answer_that_is_no_number():
    with pytest.raises(ValueError) as err:
        scores(CorrectAnswer(), ["7"], answer="seven")
    assert str(err.value) == (
        "correct_answer: the answer 'seven' (to the prompt '3 + 4 =') is not a number; this "
        "reward compares numbers, so the dataset's answer column must hold one."
    )


def test_first_number_is_ascii_digits_with_a_sign_and_a_decimal_part():
    assert first_number("x-12.5y3") == "-12.5"
    assert first_number("١٢ and 3") == "3"  # Arabic-Indic digits are not read
    assert first_number("none") is None


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("42", 1.0),
        (" 4 2 \n", 1.0),  # whitespace does not count
        ("a1", 0.5),
        ("7 apples", 1 / 7),
        ("x", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("٣", 0.0),
    ],
)
def test_digit_format_is_the_share_of_digits_among_non_space_characters(completion, expected):
    assert scores(DigitFormat(), [completion]) == pytest.approx([expected])


def test_the_total_weighs_each_reward_and_the_parts_are_unweighted():
    components = [CorrectAnswer(), DigitFormat(weight=0.5)]
    completions = ["7", "8", "a7", "none"]
    total, parts = score_completions(components, ["3 + 4 ="] * 4, completions, ["7"] * 4)
    assert list(parts) == ["correct_answer", "digit_format"]
    assert parts["correct_answer"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert parts["digit_format"].tolist() == [1.0, 1.0, 0.5, 0.0]
    assert total.tolist() == [1.5, 0.5, 1.25, 0.0]
    assert total.dtype == parts["digit_format"].dtype == torch.float32


def test_a_plain_function_is_a_reward_named_after_itself():
    def length(prompts, completions, answers):
        return torch.tensor([float(len(c)) for c in completions])

    check_rewards([length])
    total, parts = score_completions([length], ["p", "p"], ["ab", "abc"], ["1", "1"])
    assert total.tolist() == [2.0, 3.0] and list(parts) == ["length"]


class Returns(Reward):
    """A reward that returns what it is given, for the checks."""

    name = "returns"

    def __init__(self, value) -> None:
        super().__init__()
        self.value = value

    def __call__(self, prompts, completions, answers):
        return self.value


COMPLETIONS = ["7", "8", "9", "x"]


def score(value):
    return score_completions([CorrectAnswer(), Returns(value)], ["q"] * 4, COMPLETIONS, ["7"] * 4)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            [0.0, 1.0, 0.0, 1.0],
            "reward 'returns' returned a list; expected a float tensor of shape (4,), one reward "
            "per completion.",
        ),
        (
            torch.tensor([0, 1, 0, 1]),
            "reward 'returns' returned dtype torch.int64; expected a float tensor of shape (4,), "
            "one reward per completion.",
        ),
        (
            torch.zeros(4, 1),
            "reward 'returns' returned shape (4, 1); expected a float tensor of shape (4,), one "
            "reward per completion.",
        ),
        (
            torch.zeros(5),
            "reward 'returns' returned shape (5,); expected a float tensor of shape (4,), one "
            "reward per completion.",
        ),
        (
            torch.tensor([0.0, 1.0, math.nan, math.inf]),
            "reward 'returns' gave nan for completion 2 of 4 ('9'); rewards must be finite.",
        ),
        (
            torch.tensor([0.0, 1.0, 0.0, -math.inf]),
            "reward 'returns' gave -inf for completion 3 of 4 ('x'); rewards must be finite.",
        ),
    ],
    ids=["list", "integers", "column", "one too many", "nan", "inf"],
)
def test_a_bad_reward_is_named_with_its_first_bad_completion(value, message):
    with pytest.raises(ValueError) as err:
        score(value)
    assert str(err.value) == message


def test_a_long_completion_is_cut_in_the_message():
    long = "y" * 200
    with pytest.raises(ValueError, match=r"completion 0 of 1 \('y{60}'\.\.\.\); rewards must"):
        score_completions([Returns(torch.tensor([math.nan]))], ["q"], [long], ["7"])


def test_sequences_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match=r"^score_completions got 2 prompts, 3 completions and 3 "):
        score_completions([DigitFormat()], ["q"] * 2, ["1"] * 3, ["1"] * 3)


def test_success_is_a_positive_correct_answer():
    components = [CorrectAnswer(), DigitFormat(weight=0.5)]
    _, parts = score_completions(components, ["q"] * 4, ["7", "8", "x7", "77"], ["7"] * 4)
    assert successes(components, parts).tolist() == [True, False, True, False]
    assert successes([DigitFormat()], parts) is None


def test_build_rewards_instantiates_the_config_list():
    cfg = OmegaConf.create(
        {
            "rewards": [
                {"_component_": "exactga.grpo.rewards.CorrectAnswer"},
                {"_component_": "exactga.grpo.rewards.DigitFormat", "weight": 0.5},
            ]
        }
    )
    correct, digits = build_rewards(cfg.rewards)
    assert isinstance(correct, CorrectAnswer) and correct.weight == 1.0
    assert isinstance(digits, DigitFormat) and digits.weight == 0.5


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        (
            {"_component_": "exactga.grpo.rewards.CorrectAnswer"},
            r"^config key 'rewards' must be a list ",
        ),
        ([], r"^config key 'rewards' is empty"),
        (
            ["exactga.grpo.rewards.CorrectAnswer"],
            r"^config key 'rewards\[0\]' must be a section with ",
        ),
        (
            [
                {"_component_": "exactga.grpo.rewards.DigitFormat"},
                {"_component_": "exactga.grpo.rewards.DigitFormat", "weight": 0.5},
            ],
            r"^config key 'rewards\[1\]' \(digit_format\) has the name 'digit_format' of "
            r"rewards\[0\]; their metrics would be one\.",
        ),
        (
            [{"_component_": "exactga.grpo.rewards.DigitFormat", "weight": "nan"}],
            r"^config key 'rewards\[0\]' \(digit_format\): weight 'nan' is not a number\.$",
        ),
        (
            [{"_component_": "exactga.grpo.rewards.DigitFormat", "weight": float("inf")}],
            r"^config key 'rewards\[0\]' \(digit_format\): weight inf is not finite\.$",
        ),
        (
            [{"_component_": "builtins.dict"}],
            r"^config key 'rewards\[0\]' \(dict\) is a dict, not a callable on \(prompts, ",
        ),
    ],
    ids=["a section", "empty", "a string", "one name twice", "text weight", "inf", "no callable"],
)
def test_a_bad_rewards_config_is_named_at_start_up(rewards, message):
    cfg = OmegaConf.create({"rewards": rewards})
    with pytest.raises(ValueError, match=message):
        build_rewards(cfg.rewards)


def test_character_share_counts_the_named_characters_among_non_space_ones():
    vowels = CharacterShare("aeiou")
    assert scores(vowels, ["tea", "xyz", "a e", " "]) == pytest.approx([2 / 3, 0.0, 1.0, 0.0])
    assert reward_name(vowels) == "character_share"
    with pytest.raises(ValueError, match="character_share: 'characters' is empty"):
        CharacterShare("")
