import pandas as pd
import pytest

from optlab.core.results import published
from optlab.core.errors import OptlabError


def test_published_figures_carry_their_source_and_the_speedup_they_claim():
    table = published.published_figures()
    assert list(table.columns[:7]) == published.COLUMNS and table["url"].str.startswith("https://").all()
    flex = table.set_index("claim").loc["FlexAttention"]
    assert flex["speed-up (as published)"] == pytest.approx(7.2 / 5.03)  # a time: before / after
    linear = table[table["claim"].str.contains("linear")].iloc[0]
    assert linear["speed-up (as published)"] == pytest.approx(0.80)  # a rate: after / before


def test_a_published_table_without_its_columns_or_with_a_bad_number_is_refused(tmp_path, monkeypatch):
    class Folder:
        def joinpath(self, name):
            return tmp_path / name

    monkeypatch.setattr(published.resources, "files", lambda package: Folder())
    pd.DataFrame({"source": ["x"], "claim": ["y"]}).to_csv(tmp_path / "short.csv", index=False)
    with pytest.raises(OptlabError, match="missing columns"):
        published.published_figures("short.csv")
    row = dict(source="x", claim="y", hardware="z", before=0.0, after=1.0, unit="minutes", url="https://x")
    pd.DataFrame([row]).to_csv(tmp_path / "zero.csv", index=False)
    with pytest.raises(OptlabError, match="positive"):
        published.published_figures("zero.csv")
