"""Code prompts: what counts as a candidate (public functions and classes with a docstring,
cut as the file spells them), and a selection that is deterministic, mixes the kinds, spreads
over files, and comes from held-out stdlib files only."""

import textwrap

import pytest

from effdl.data.code_prompts import prompt_candidates, select_prompts
from effdl.data.stdlib_code import SourceFile, is_heldout, stdlib_code_corpus

SOURCE = textwrap.dedent('''\
    import os


    def public(a, b=1):
        """Add b to a.

        Returns the sum.
        """
        return a + b


    def _private(x):
        """Hidden."""
        return x


    def undocumented(x):
        return x


    class Widget(Base,
                 metaclass=Meta):
        """A widget."""

        def draw(self, canvas):
            """Draw on canvas."""
            def inner():
                """Nested in a function: not a prompt."""

        def size(self): return 1


    class Bare:
        x = 1
    ''')


def test_candidates_are_documented_public_definitions_as_written():
    found = prompt_candidates(SourceFile("demo.py", SOURCE))
    assert [(p.name, p.kind, p.line) for p in found] == [
        ("public", "function", 4),
        ("Widget", "class", 21),
        ("Widget.draw", "function", 25),
    ]
    assert (
        found[0].text
        == 'def public(a, b=1):\n    """Add b to a.\n\n    Returns the sum.\n    """\n'
    )
    assert (
        found[1].text == 'class Widget(Base,\n             metaclass=Meta):\n    """A widget."""\n'
    )
    assert found[2].text == '    def draw(self, canvas):\n        """Draw on canvas."""\n'
    assert prompt_candidates(SourceFile("bad.py", "def (:\n")) == []


def demo_files(n: int) -> list[SourceFile]:
    files = []
    for i in range(n):
        body = f'def f{i}(x):\n    """Return x plus {i}, a number."""\n    return x + {i}\n\n'
        body += f'class C{i}:\n    """The class number {i} of this demo."""\n'
        files.append(SourceFile(f"m{i}.py", body))
    return files


def test_selection_is_deterministic_mixed_and_one_per_file_while_files_last():
    picked = select_prompts(demo_files(12), 10)
    assert [p.kind for p in picked] == ["function"] * 7 + ["class"] * 3
    assert len({p.path for p in picked}) == 10
    assert picked == select_prompts(list(reversed(demo_files(12))), 10)
    few = select_prompts(demo_files(4), 6)  # 4 files: two give a second prompt
    assert sorted(p.path for p in few[:4]) == [f"m{i}.py" for i in range(4)]
    with pytest.raises(ValueError, match="hold 2 function prompts, need 4"):
        select_prompts(demo_files(2), 6)


@pytest.mark.parametrize("max_bytes", [None, 1 << 20])
def test_stdlib_prompts_come_from_held_out_files(max_bytes):
    corpus = stdlib_code_corpus(max_bytes)
    picked = select_prompts(corpus.heldout, 10)
    assert len(picked) == 10 and [p.kind for p in picked].count("class") == 3
    assert all(is_heldout(p.path) for p in picked)
    texts = {f.path: f.text for f in corpus.heldout}
    for p in picked:
        assert p.text in texts[p.path]
        assert p.text.lstrip().startswith(("def ", "async def ", "class "))
        assert '"""' in p.text or "'''" in p.text
