"""kvsim dashboard: ``streamlit run dashboard/app.py -- --runs-dir runs`` (or ``kvsim dashboard``).

One page per file under ``dashboard/views/``; the Sweeps page is listed only when the runs
directory holds sweep results (``sweeps/*/sweep.json``). The folder is not named ``pages/``:
Streamlit treats a ``pages/`` folder beside the entrypoint as a v1 multipage app, and a
first visit straight to ``/run_explorer`` would then run that page without this script (no
wide layout, every file of the folder listed, Sweeps included) until someone opened ``/``.

Errors: each page shows what it expects to fail (bad input, a broken run directory) as one
message (``dashboard.errors``); anything that still escapes a page is caught here and shown the
same way, never as a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

# `streamlit run` puts dashboard/ on sys.path, not the repository root that holds the
# `dashboard` and `sim` packages; an uninstalled checkout needs the root too.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Only light modules before the first element: pandas, pyarrow, plotly and the simulator
# load inside the page, after its title is on screen.
from dashboard.errors import show_error  # noqa: E402
from dashboard.locations import list_sweeps, runs_dir  # noqa: E402
from dashboard.warmup import warm_up  # noqa: E402

VIEWS = Path(__file__).resolve().parent / "views"

st.set_page_config(page_title="kvsim", layout="wide")

pages = [
    st.Page(VIEWS / "what_if.py", title="What-if", default=True),
    st.Page(VIEWS / "run_explorer.py", title="Run explorer"),
    st.Page(VIEWS / "compare.py", title="Compare"),
]
base = runs_dir()
if list_sweeps(base):
    pages.append(st.Page(VIEWS / "sweeps.py", title="Sweeps"))

page = st.navigation(pages)
st.sidebar.caption(f"runs directory: `{base}`")
try:
    page.run()
except Exception as exc:  # the pages catch what they expect; nothing may reach the browser raw
    show_error(exc, f"{page.title} page")
finally:
    warm_up()  # after the first page is drawn: the other pages' modules, in the background
