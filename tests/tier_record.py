"""A pytest plugin for tests/test_tiers.py: it writes the tests a run selected and those it deselected, each with its
file, fixtures and markers, as JSON to the file named by ``OPTLAB_TIER_RECORD``."""
import json
import os
from pathlib import Path

DESELECTED: list = []


def describe(item) -> dict:
    return {"nodeid": item.nodeid, "name": getattr(item, "originalname", item.name), "file": item.path.name,
            "fixtures": list(item.fixturenames), "markers": sorted({mark.name for mark in item.iter_markers()})}


def pytest_deselected(items):
    DESELECTED.extend(items)


def pytest_collection_finish(session):
    record = {"selected": list(map(describe, session.items)), "deselected": list(map(describe, DESELECTED))}
    Path(os.environ["OPTLAB_TIER_RECORD"]).write_text(json.dumps(record))
