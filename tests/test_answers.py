"""The answers and targets tables against tables written out by hand."""

import pytest

from effdl.answers import Answer, Target, anchor, answers_table, targets_table


def test_anchor_is_the_heading_with_hyphens_for_spaces():
    assert anchor("## Loss curves (fp16)") == "#Loss-curves-(fp16)"
    assert anchor("Ответы") == "#Ответы"


def test_answers_table_links_each_row_to_its_section_and_escapes_pipes():
    text = answers_table([Answer("Which is faster?", "ours, 1.2x | 3 runs", "Speed by batch")])
    assert text.splitlines() == [
        "| Asked | Answer | Shown in |",
        "|---|---|---|",
        "| Which is faster? | ours, 1.2x \\| 3 runs | [Speed by batch](#Speed-by-batch) |",
    ]


def test_targets_table_says_met_not_met_or_not_measured():
    rows = [Target("MFU >= 45%", "51.1%", True), Target("1.15x torchtitan", "1.02x", False),
            Target("peak < 90%", None, None)]  # fmt: skip
    assert targets_table(rows).splitlines()[2:] == [
        "| MFU >= 45% | 51.1% | met |",
        "| 1.15x torchtitan | 1.02x | **not met** |",
        "| peak < 90% | not measured | not measured |",
    ]
    assert "не выполнено" in targets_table(rows, lang="ru")


@pytest.mark.parametrize(
    "printed", ["nan ms", "the backward of GELU nanx", "inf%", "-inf", "(nan)"]
)
def test_a_row_printing_nan_or_inf_is_refused(printed):
    with pytest.raises(ValueError, match="'Backward vs forward' prints a NaN or an infinity"):
        answers_table([Answer("Backward vs forward", printed, "Trace")])
    with pytest.raises(ValueError, match="prints a NaN or an infinity"):
        targets_table([Target("Backward vs forward", printed, True)])


@pytest.mark.parametrize("words", ["nanoseconds", "information", "infinite loss refused", "Nan"])
def test_words_that_start_like_nan_or_inf_pass(words):
    assert words in answers_table([Answer("Asked", words, "Trace")])
