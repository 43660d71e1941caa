"""tests/mutants.py stays runnable: each bug it plants still finds the text it replaces, so a
change to the code that moves that text fails here, not in a mutation run much later."""

from __future__ import annotations

import pytest

from mutants import MUTANTS, ROOT, Mutant


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_finds_the_text_it_replaces_once(mutant: Mutant) -> None:
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, (
        f"mutant {mutant.name}: its original text is not in {mutant.path} exactly once; "
        "update it in tests/mutants.py to plant the same bug in the code as it is now"
    )
    assert mutant.new != mutant.old


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
