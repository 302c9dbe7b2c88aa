"""The documentation site: strict build, API coverage, and every example runs.

- `mkdocs build --strict` (broken links, missing pages, pages left out of the nav
  and unresolvable API references fail).
- Every name in the public `__all__` lists has an entry in the API reference and
  a rendered anchor in the built site.
- `>>>` examples in the guides and in the library's docstrings run as doctests.
- Every ```python block of a guide runs (blocks of one page share a namespace).
  Blocks that need a server or a phone are written as ```py and only shown.
"""

import doctest
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

from tests import browser

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PUBLIC = ["keras_attn.layers", "keras_attn.ops", "keras_attn.data", "keras_attn.training",
          "keras_attn.export", "keras_attn.generation", "keras_attn.convert",
          "keras_attn.visualize", "keras_attn.runtimes"]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _pages():
    return sorted(p for p in DOCS.rglob("*.md"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


def test_strict_build_renders_every_page(site):
    for page in _pages():
        rel = page.relative_to(DOCS).with_suffix("")
        html = site / ("index.html" if rel.name == "index" else rel / "index.html")
        assert html.is_file(), f"{page} was not rendered"


@pytest.mark.skipif(browser.chromium() is None, reason=browser.NO_CHROMIUM)
@pytest.mark.parametrize("page", ["index", "guides/generation", "guides/visualize"])
def test_built_pages_render_in_a_browser(site, page, tmp_path):
    """A built page opened in headless Chromium: its title in the DOM after the
    theme's scripts ran, its heading on screen, and a screenshot that is not blank."""
    source = (DOCS / page).with_suffix(".md") if page == "index" else DOCS / f"{page}.md"
    built = site / ("index.html" if page == "index" else f"{page}/index.html")
    heading = re.search(r"^# (.+)$", source.read_text(), re.M).group(1)
    title = re.search(r"<title>(.*?)</title>", built.read_text()).group(1)
    dom = browser.dump_dom(built.as_uri())
    assert f"<title>{title}</title>" in dom and "keras_attn" in title
    assert heading.replace("`", "") in re.sub(r"<[^>]+>", "", dom)
    image = browser.screenshot(built.as_uri(), tmp_path / "page.png", size=(1280, 900))
    assert 0.02 < browser.ink(image) < 0.98


def test_api_reference_covers_every_public_name(site):
    import keras_attn

    reference = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    html = "\n".join(p.read_text() for p in (site / "api").rglob("*.html"))
    missing, unrendered = [], []
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            qualified = f"{module_name}.{name}"
            if f"::: {qualified}\n" not in reference:
                missing.append(qualified)
            elif f'id="{qualified}"' not in html:
                unrendered.append(qualified)
    layers = importlib.import_module("keras_attn.layers").__all__
    for name in keras_attn.__all__:
        if name in ("ops", "saving", "config"):
            assert f"::: keras_attn.{name}" in reference, name
        elif name == "activations":
            assert "::: keras_attn.layers.activations" in reference, name
        elif name != "__version__" and name not in layers:
            missing.append(f"keras_attn.{name}")
    assert not missing, f"not in docs/api/*.md: {missing}"
    assert not unrendered, f"no anchor in the built site: {unrendered}"


def _doctest_pages():
    return [p for p in _pages() if ">>> " in p.read_text()]


@pytest.mark.parametrize("page", _doctest_pages(), ids=lambda p: p.name)
def test_guide_doctests(page):
    result = doctest.testfile(str(page), module_relative=False, optionflags=FLAGS,
                              report=True)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {page} (see above)"


def _python_pages():
    return [p for p in _pages() if re.search(r"```python\n(?!>>>)", p.read_text())]


@pytest.mark.parametrize("page", _python_pages(), ids=lambda p: p.name)
def test_guide_python_blocks_run(page):
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
              if not b.lstrip().startswith(">>>")]
    namespace = {"__name__": f"docs_{page.stem}"}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 - our own docs


DOCSTRING_MODULES = [
    "keras_attn.layers.additive_attention", "keras_attn.layers.alibi_bias",
    "keras_attn.layers.dot_product_attention", "keras_attn.layers.learned_position_embedding",
    "keras_attn.layers.multi_head_attention", "keras_attn.layers.relative_position_bias",
    "keras_attn.layers.rotary_embedding", "keras_attn.layers.sentence_pooling",
    "keras_attn.layers.sinusoidal_position_encoding",
    "keras_attn.layers.token_and_position_embedding", "keras_attn.layers.transformer_decoder_block",
    "keras_attn.layers.transformer_encoder_block", "keras_attn.ops.attention",
    "keras_attn.ops.masking", "keras_attn.checks", "keras_attn.generation.models",
    "keras_attn.export.check",
    "keras_attn.visualize.maps",
]


@pytest.mark.parametrize("module_name", DOCSTRING_MODULES)
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=FLAGS, report=True)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"


def test_readme_links_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, missing
