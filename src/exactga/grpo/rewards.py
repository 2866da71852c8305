"""Reward components for GRPO: callables that score completions, and the one function that
checks and sums them.

A reward component is any callable ``(prompts, completions, answers) -> torch.Tensor`` that
gives one float reward per completion (shape ``(n,)``), the three sequences aligned (completion
``i`` answers ``prompts[i]``, whose reference answer is ``answers[i]``). It may carry a
``name`` (the key of its metrics; default its class name), a ``weight`` (default 1.0) and
``defines_success`` (default False). The config lists them, each a torchtune ``_component_``:

.. code-block:: yaml

    rewards:
      - _component_: exactga.grpo.rewards.CorrectAnswer       # 1.0 when the first number is right
      - _component_: exactga.grpo.rewards.DigitFormat         # share of the characters that are
      digits
        weight: 0.5

:func:`build_rewards` instantiates that list and checks it at start-up;
:func:`score_completions` calls each component and checks what it returns (see [checked
rewards]); :func:`successes` says which completions succeeded, for the success rate. To write
a component, subclass :class:`Reward` and define ``score`` for one completion, or define
``__call__`` for the whole batch.

Note [checked rewards]
A reward of the wrong shape would broadcast into the group advantages or be cut silently, and a
NaN would spread through every advantage of its group and then through the loss. So every
component's output is checked at every step: a ``torch.Tensor`` of a floating dtype, of shape
``(n,)``, every value finite; otherwise one ``ValueError`` names the component and, for a value,
the first bad completion. The check is a few reductions over ``n`` numbers on the host, next to
a generation that costs seconds.

Note [a climbable format reward]
GRPO learns only from the spread of rewards within a group of completions of one prompt (the
advantages are the rewards centred and scaled per group), so a reward that is 0 for every
completion a model samples teaches it nothing. A randomly initialised tiny model samples nearly
uniformly from its 2048 token ids (the 48 past the tokenizer's 2000 pieces cannot be decoded:
sentencepiece raises on them, so generation masks them or decoding drops them); the tiny
tokenizer has 10 digit pieces and 10 digit bytes, so a completion of 12 tokens holds a digit
about one time in eight (``1 - (1 - 20/2048)^12``), and almost never ends right after a number
(the end-of-sequence id is 1 of 2048). A reward for the right number, or for "exactly one
number", is then 0 for nearly every group. :class:`DigitFormat`
scores the share of a completion's non-space characters that are digits: some completions of
most groups score above 0, so the policy gradient has a direction from the first step (every
digit up), and the share keeps rising smoothly as digits become likelier. Measured on the tiny
model (``init_seed`` 0, 8 shipped prompts x 8 completions of 12 tokens at temperature 1, four
sampling seeds): mean 0.0035 to 0.0040, 12.5 to 14 % of completions above 0, 4 to 6 of the 8
groups with a spread. A plain on-policy policy-gradient loop on ``correct_answer + 0.5 *
digit_format`` (sequence mean, :func:`exactga.grpo.policy.group_advantages`, AdamW lr 1e-3, gradient
clip 1.0, no KL, 8 x 8 completions a step) took it past 0.5 in 26 steps and past 0.9 in 34.
Its maximum is any all-digit completion, not the right answer, and that run ended on
``"999999999999"``: :class:`CorrectAnswer` reads the *first* number, so a run of digits is one
wrong number, and once digits dominate that reward is the one left to climb.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torchtune import config

# What :func:`score_completions` accepts: prompts, completions, answers -> one reward each.
RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[str]], torch.Tensor]

# A number in a completion or an answer: an optional minus sign, ASCII digits, an optional
# decimal part. ASCII only: ``\d`` also matches other scripts' digits.
NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
DIGITS = frozenset("0123456789")


class Reward:
    """A reward component scored one completion at a time; subclasses define :meth:`score`.

    Args:
        weight: the factor of this reward in the total (:func:`score_completions`). 0 keeps it
            as a logged metric that does not train.
    """

    # The key of its metrics; without one, its class's name (see reward_name).
    name: str
    # Whether a positive reward from this component means the completion succeeded; see
    # :func:`successes`.
    defines_success = False

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]
    ) -> torch.Tensor:
        scores = [
            self.score(prompt, completion, answer)
            for prompt, completion, answer in zip(prompts, completions, answers, strict=True)
        ]
        return torch.tensor(scores, dtype=torch.float32)

    def score(self, prompt: str, completion: str, answer: str) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(weight={self.weight})"


class CorrectAnswer(Reward):
    """1.0 when the first number in the completion equals the answer, else 0.0; it defines
    success.

    Numbers compare by value (``"07"`` and ``"7.0"`` equal ``"7"``). A completion with no number
    scores 0.0.

    Raises:
        ValueError: an answer that is not a number (the data is at fault: this reward is for
            numeric answers).
    """

    name = "correct_answer"
    defines_success = True

    def score(self, prompt: str, completion: str, answer: str) -> float:
        expected = _as_number(answer)
        if expected is None:
            raise ValueError(
                f"{self.name}: the answer {answer!r} (to the prompt {prompt!r}) is not a number; "
                "this reward compares numbers, so the dataset's answer column must hold one."
            )
        found = first_number(completion)
        return float(found is not None and _as_number(found) == expected)


class CharacterShare(Reward):
    """The share of the completion's non-whitespace characters that are among ``characters``,
    in ``[0, 1]``; 0.0 for a completion of whitespace alone. :class:`DigitFormat` is this for
    ASCII digits. With a common set (``characters: aeiou``) nearly every completion of a random
    model scores differently, so every group has a spread from the first step: a reward for
    smoke tests and parity checks (configs/tiny/ga_parity_grpo.yaml), not for a task.

    Raises:
        ValueError: an empty ``characters``.
    """

    name = "character_share"

    def __init__(self, characters: str, weight: float = 1.0) -> None:
        super().__init__(weight)
        if not characters:
            raise ValueError(f"{self.name}: 'characters' is empty; name the characters to count.")
        self.characters = frozenset(characters)

    def score(self, prompt: str, completion: str, answer: str) -> float:
        characters = "".join(completion.split())
        if not characters:
            return 0.0
        return sum(ch in self.characters for ch in characters) / len(characters)


class DigitFormat(CharacterShare):
    """The share of the completion's non-whitespace characters that are ASCII digits, in
    ``[0, 1]``; 0.0 for a completion of whitespace alone. A dense reward a randomly initialised
    model can climb; see [a climbable format reward]."""

    name = "digit_format"

    def __init__(self, weight: float = 1.0) -> None:
        super().__init__("".join(sorted(DIGITS)), weight)


def first_number(text: str) -> str | None:
    """The first number in ``text`` (see ``NUMBER``), or None."""
    match = NUMBER.search(text)
    return None if match is None else match.group()


def _as_number(text: str) -> Decimal | None:
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


# ---------------------------------------------------------------------------------------------
# Building the components, and scoring a step's completions.


def reward_name(component: Any) -> str:
    """A component's metric name: its ``name``, else its class's (or function's) name."""
    name = getattr(component, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(component, "__name__", type(component).__name__)


def reward_weight(component: Any) -> float:
    """A component's ``weight`` (1.0 if it has none)."""
    return getattr(component, "weight", 1.0)


def build_rewards(cfg_rewards: ListConfig | Sequence[DictConfig]) -> list[RewardFn]:
    """Instantiate config key ``rewards``, a list of ``_component_`` sections, and check the
    components (:func:`check_rewards`).

    Raises:
        ValueError: ``rewards`` not a non-empty list of sections, or a bad component, named by
            its place (``rewards[1]``).
    """
    if isinstance(cfg_rewards, str) or not isinstance(cfg_rewards, Sequence):
        raise ValueError(
            f"config key 'rewards' must be a list of reward components (each with a "
            f"_component_), got {type(cfg_rewards).__name__}."
        )
    components = []
    for index, section in enumerate(cfg_rewards):
        if not isinstance(section, Mapping) or "_component_" not in section:
            raise ValueError(
                f"config key 'rewards[{index}]' must be a section with a _component_ (e.g. "
                f"exactga.grpo.rewards.CorrectAnswer), got {section!r}."
            )
        components.append(config.instantiate(section))
    check_rewards(components)
    return components


def check_rewards(components: Sequence[Any]) -> None:
    """Fail at start-up on a list of reward components that :func:`score_completions` could
    not use: empty, one not callable, a weight that is not a finite number, or two with one
    name (their metrics would collide).

    Raises:
        ValueError: naming the component by its place, ``rewards[i]``.
    """
    if not components:
        raise ValueError("config key 'rewards' is empty: GRPO needs at least one reward.")
    seen: dict[str, int] = {}
    for index, component in enumerate(components):
        where = f"config key 'rewards[{index}]' ({reward_name(component)})"
        if not callable(component):
            raise ValueError(
                f"{where} is a {type(component).__name__}, not a callable on (prompts, "
                "completions, answers)."
            )
        weight = reward_weight(component)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"{where}: weight {weight!r} is not a number.")
        if not math.isfinite(weight):
            raise ValueError(f"{where}: weight {weight} is not finite.")
        name = reward_name(component)
        if name in seen:
            raise ValueError(
                f"{where} has the name {name!r} of rewards[{seen[name]}]; their metrics would "
                "be one. Give one a different name."
            )
        seen[name] = index


def score_completions(
    components: Sequence[RewardFn],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each component's rewards, checked, and their weighted sum.

    Returns:
        ``(total, per_component)``: ``total`` of shape ``(n,)``, ``sum_k weight_k * r_k``
        (summed in fp64, returned in fp32, on the CPU), and each component's own rewards by
        name, unweighted (fp32, on the CPU).

    Raises:
        ValueError: sequences of different lengths, or a component's output of the wrong type,
            dtype or shape, or not finite, naming the component and the first bad completion.
            See [checked rewards].
    """
    num_completions = len(completions)
    if len(prompts) != num_completions or len(answers) != num_completions:
        raise ValueError(
            f"score_completions got {len(prompts)} prompts, {num_completions} completions and "
            f"{len(answers)} answers: one prompt and one answer per completion (a prompt "
            "repeated for each completion of its group)."
        )
    total = torch.zeros(num_completions, dtype=torch.float64)
    per_component = {}
    for component in components:
        rewards = component(prompts, completions, answers)
        _check_output(reward_name(component), rewards, completions)
        rewards = rewards.detach().to("cpu", torch.float32)
        per_component[reward_name(component)] = rewards
        total += reward_weight(component) * rewards.double()
    return total.float(), per_component


def _check_output(name: str, rewards: Any, completions: Sequence[str]) -> None:
    """Fail naming ``name`` unless ``rewards`` is finite floats, one per completion."""
    num_completions = len(completions)
    expected = f"a float tensor of shape ({num_completions},), one reward per completion"
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(
            f"reward {name!r} returned a {type(rewards).__name__}; expected {expected}."
        )
    if not rewards.is_floating_point():
        raise ValueError(f"reward {name!r} returned dtype {rewards.dtype}; expected {expected}.")
    if tuple(rewards.shape) != (num_completions,):
        raise ValueError(
            f"reward {name!r} returned shape {tuple(rewards.shape)}; expected {expected}."
        )
    finite = torch.isfinite(rewards)
    if not bool(finite.all()):
        bad = int((~finite).nonzero()[0])
        raise ValueError(
            f"reward {name!r} gave {float(rewards[bad])} for completion {bad} of "
            f"{num_completions} ({_preview(completions[bad])}); rewards must be finite."
        )


def _preview(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def successes(
    components: Sequence[RewardFn], per_component: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    """Which completions succeeded: those to which every component with ``defines_success``
    (:class:`CorrectAnswer`) gave a positive reward; a bool tensor of shape ``(n,)``, or None
    when no component defines success (then there is no success rate to log)."""
    defining = [reward_name(c) for c in components if getattr(c, "defines_success", False)]
    if not defining:
        return None
    succeeded = per_component[defining[0]] > 0
    for name in defining[1:]:
        succeeded &= per_component[name] > 0
    return succeeded
