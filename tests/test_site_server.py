"""The preview server of ``make serve`` and the browser test: the site under its prefix, the 404 page elsewhere."""
import http.client
import threading

import pytest

from tools.site_server import make_server, site_prefix


@pytest.fixture
def server(tmp_path):
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "a.html").write_text("page a")
    (tmp_path / "index.html").write_text("index")
    (tmp_path / "404.html").write_text("not found page")
    running = make_server(tmp_path, "/site/")
    threading.Thread(target=running.serve_forever, daemon=True).start()
    yield running.server_address
    running.shutdown()


def get(address, path: str) -> tuple[int, str, str]:
    connection = http.client.HTTPConnection(*address, timeout=10)
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, response.read().decode(), response.getheader("Location") or ""


def test_the_site_is_served_under_its_prefix_only(server):
    assert get(server, "/site/book/a.html")[:2] == (200, "page a")
    assert get(server, "/site/")[:2] == (200, "index")
    assert get(server, "/site") == (301, "", "/site/")
    for outside in ("/book/a.html", "/site/../book/a.html", "/site/book/missing.html", "/site/../../etc/passwd"):
        assert get(server, outside)[:2] == (404, "not found page"), outside


@pytest.mark.parametrize("url", ["https://github.com/some-owner/some-repo", "https://github.com/some-owner/some-repo/"])
def test_the_prefix_is_the_repository_name_not_its_owner(tmp_path, url):
    config = tmp_path / "_config.yml"
    config.write_text(f"title: x\nrepository:\n  url: {url}\n  branch: main\n")
    assert site_prefix(config) == "/some-repo/"
