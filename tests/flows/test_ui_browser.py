"""The real UIs, driven in headless Chromium: `posttrain ui` (a real `prefect server` and `mlflow
server`) and `posttrain serve tests/support/configs/ui_pipeline.yaml` (the on-demand deployment), then

  * a first run of the deployment through Prefect's REST API, waited for;
  * a second run from the deployment's run form ("Run" > "Custom run"), with the sft node's
    max_steps edited in the form, waited for;
  * in Prefect: the run's task runs are named after the nodes (graph and Task Runs tab), the data
    prep node (unchanged) is shown "Cached", the run's Artifacts tab has the `<pipeline>-summary`
    markdown artifact whose links open this `posttrain ui`'s MLflow;
  * in MLflow: the linked pipeline run, the registered model with its versions and aliases
    (champion from the first run, candidate from the second).

and in MLflow also: the experiment link opening the runs table, the evaluate node's models side by
side (one exact_match per model in the compare view of its per-model runs), the registered
version's signature (inputs: prompt) and its links to the source run and the logged model.

Screenshots: every step saves a PNG (NN-what.png) into test-artifacts/ui/ at the repo root (or
$POSTTRAIN_UI_ARTIFACTS), git-ignored; CI uploads that folder as an artifact. The servers' and
`serve`'s logs are copied there too (ui.log, serve.log).

Takes ~6-10 minutes on 2 busy CPU cores (two pipeline runs of ~2-3 min each, servers' start-up).
Skips only where Chromium cannot be installed (no /usr/bin/chromium, and not root with apt-get:
`make setup` installs it) or the playwright package is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.support.ui_browser import (ARTIFACTS, ROOT, PrefectAPI, Proc, child_env, chromium, free_port, posttrain,
                              shot)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CONFIG = ROOT / "tests" / "support" / "configs" / "ui_pipeline.yaml"
PIPELINE = "ui-browser"  # CONFIG's name: the artifact is "<name>-summary"
MODEL = "ui-browser-model"  # CONFIG's registry.model_name
EXPERIMENT = "ui-browser-experiment"  # CONFIG's tracking.experiment
NODES = ["prep", "sft", "evaluate"]
EDITED = ("sft", "max_steps", 4, 6)  # node, field, value in CONFIG, value typed into the form
RUN_TIMEOUT_S = 900
VIEWPORT = {"width": 1400, "height": 1000}
UI_TIMEOUT_MS = 60_000  # an SPA on a busy 2-core machine: first paint of a page can take a while


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install -e '.[test]')")
    exe = chromium()
    if exe is None:
        pytest.skip("Chromium is missing and cannot be installed here: no /usr/bin/chromium, and installing "
                    "Debian's `chromium` needs root and apt-get (`make setup` does it where it can)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


class Stack:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.prefect_port, self.mlflow_port = free_port(), free_port()
        while self.mlflow_port == self.prefect_port:
            self.mlflow_port = free_port()
        self.prefect = f"http://127.0.0.1:{self.prefect_port}"
        self.mlflow = f"http://127.0.0.1:{self.mlflow_port}"
        self.api = PrefectAPI(f"{self.prefect}/api")
        self.env = child_env(self.prefect_port, self.mlflow_port, workdir / "prefect-home")
        self.procs: list[Proc] = []
        self.deployment: dict = {}
        self.runs: dict[str, dict] = {}  # "api" / "form" -> the finished flow run

    def start(self) -> None:
        ui = Proc("posttrain ui", posttrain("ui", "--prefect-port", str(self.prefect_port), "--mlflow-port",
                                            str(self.mlflow_port)), self.workdir, self.env, self.workdir / "ui.log")
        self.procs.append(ui)
        ui.wait_for_line("stops both", 300)
        time.sleep(2)
        # A port another server held answers the health checks too; `posttrain ui` then exits.
        assert ui.proc.poll() is None, f"posttrain ui exited right after starting:\n{ui.tail()}"
        settings = json.loads(urllib.request.urlopen(f"{self.prefect}/ui-settings", timeout=10).read())
        assert settings["api_url"] == f"{self.prefect}/api", f"the Prefect UI would call another API: {settings}"
        serve = Proc("posttrain serve", posttrain("serve", str(CONFIG)), self.workdir, self.env,
                     self.workdir / "serve.log")
        self.procs.append(serve)
        self.deployment = self.api.deployment("post_training", "on-demand", proc=serve)

    @property
    def serve(self) -> Proc:
        return self.procs[1]

    def stop(self) -> None:
        for proc in reversed(self.procs):  # serve first, then ui (SIGTERM: it stops both servers)
            proc.stop()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for proc in self.procs:
            shutil.copy(proc.log_path, ARTIFACTS / proc.log_path.name)


@pytest.fixture(scope="module")
def stack(browser, tmp_path_factory):
    """The servers, the served deployment and its two finished runs (the second from the form)."""
    if ARTIFACTS.exists():
        shutil.rmtree(ARTIFACTS)
    ARTIFACTS.mkdir(parents=True)
    s = Stack(tmp_path_factory.mktemp("ui-browser"))
    try:
        s.start()
        first = s.api.create_run(s.deployment["id"], name=f"api-{uuid.uuid4().hex[:6]}")
        s.runs["api"] = s.api.wait(first["id"], RUN_TIMEOUT_S, s.serve)
        run_id, name = run_from_form(s, browser)
        assert s.api.flow_run(run_id)["name"] == name, "the run form's Run Name was not the run's name"
        s.runs["form"] = s.api.wait(run_id, RUN_TIMEOUT_S, s.serve)
        yield s
    finally:
        s.stop()


def new_page(browser):
    ctx = browser.new_context(viewport=VIEWPORT)  # a fresh user: no cookies, no localStorage
    ctx.set_default_timeout(UI_TIMEOUT_MS)
    return ctx, ctx.new_page()


# --- the run form -------------------------------------------------------------------------------------


def _walk_and_set(value, path: list[str], new) -> bool:
    """Set `new` at the end of `path` in `value`, starting from wherever the path's head is found
    (the editor may hold config.nodes, the nodes, or the whole parameters)."""
    for start in range(len(path)):
        cur, ok = value, True
        for key in path[start:-1]:
            if isinstance(cur, dict) and key in cur:
                cur = cur[key]
            else:
                ok = False
                break
        if ok and isinstance(cur, dict) and path[-1] in cur:
            cur[path[-1]] = new
            return True
    return False


def set_form_value(page, path: list[str], new, labels: list[str]):
    """Type `new` into the run form's field for parameter `path` (e.g. config.nodes.sft.max_steps):
    a text field labelled with one of `labels` (the form's titles), else the JSON editor that holds
    the path (Prefect renders a dict of unions, as `nodes` is, as JSON). Returns the element edited."""
    node = path[-2]
    for label in labels:  # the node's section ("<node> (<KIND>)", flows/form.py), then the field titled so
        field = page.locator(f"xpath=(//*[starts-with(normalize-space(text()), '{node} (')])[1]"
                             f"/following::*[normalize-space(text())='{label}'][1]/following::input[1]")
        if field.count() == 1:
            field.fill(str(new))
            return field
    for label in labels:  # one field with that label, inside the node's own section if there are several
        fields = page.get_by_label(re.compile(rf"^\s*{re.escape(label)}\b", re.I))
        if fields.count() > 1:
            fields = page.locator(".schema-form-property").filter(has_text=path[-2]).get_by_label(
                re.compile(rf"^\s*{re.escape(label)}\b", re.I))
        if fields.count() == 1:
            fields.first.fill(str(new))
            return fields.first
    editors = page.locator("textarea.p-code-input__textarea, textarea")
    for i in range(editors.count()):
        ed = editors.nth(i)
        try:
            value = json.loads(ed.input_value() or "null")
        except json.JSONDecodeError:
            continue
        if _walk_and_set(value, path, new):
            ed.fill(json.dumps(value, indent=2))
            return ed
    found = [t.strip() for t in page.locator(".schema-form-property__label, label").all_inner_texts() if t.strip()]
    raise AssertionError(f"the run form has no field for {'.'.join(path)}: no field labelled {labels}, and no "
                         f"JSON editor holding that path. Labels on the form: {found[:80]}")


def run_from_form(s: Stack, browser) -> tuple[str, str]:
    """Deployment page > Run > Custom run; edit one parameter and the run's name; submit; "View run"
    in the toast. Returns (flow run id, name)."""
    node, field, old, new = EDITED
    ctx, page = new_page(browser)
    try:
        page.goto(f"{s.prefect}/deployments/deployment/{s.deployment['id']}")
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run").click()
        page.wait_for_url(re.compile(r"/run(\?|$)"))
        page.get_by_text("Run Name", exact=True).wait_for()
        page.wait_for_load_state("networkidle")
        shot(page, "01-run-form")
        name = f"form-{field.replace('_', '-')}-{new}-{uuid.uuid4().hex[:6]}"
        name_input = page.get_by_label("Run Name", exact=True)
        if name_input.count() != 1:
            name_input = page.locator(".flow-run-name-input input")
        name_input.fill(name)
        edited = set_form_value(page, ["config", "nodes", node, field], new,
                                labels=[field.replace("_", " ").capitalize(), field.replace("_", " ").title(), field])
        # show the edited line: in the JSON editor, the highlighted copy of the text holds it
        target = page.locator(".p-code-input__view").get_by_text(f'"{field}"', exact=True)
        for _ in range(5):  # the highlighted copy re-renders after typing
            try:
                (target.first if target.count() else edited).scroll_into_view_if_needed(timeout=5000)
                break
            except Exception:  # noqa: BLE001 - detached mid-render: find it again
                page.wait_for_timeout(500)
        shot(page, "02-run-form-edited")
        page.get_by_role("button", name="Submit").click()
        # Prefect goes back to the deployment page with a toast: "<name> scheduled to start now", "View run"
        toast = page.get_by_text(name).first
        toast.wait_for()
        try:  # the deployment page behind it
            page.get_by_role("tab", name="Runs", exact=True).wait_for(timeout=20_000)
        except Exception:  # noqa: BLE001 - seen blank on a busy machine: the screenshot shows it
            pass
        page.wait_for_load_state("networkidle")
        shot(page, "03-after-submit")
        try:  # the toast re-renders while it counts down: a plain click may never find it stable
            page.locator(".toast-flow-run-create__button").first.click(force=True, timeout=10_000)
            page.wait_for_url(re.compile(r"/runs/flow-run/[0-9a-f-]{36}"), timeout=20_000)
            page.get_by_text(name, exact=True).first.wait_for()
            shot(page, "03b-form-run-started")
            return re.search(r"/runs/flow-run/([0-9a-f-]{36})", page.url).group(1), name
        except Exception:  # noqa: BLE001 - the toast has gone: the run by its name
            runs = [r for r in s.api.flow_runs(s.deployment["id"]) if r["name"] == name]
            assert runs, f"submitting the run form created no flow run named {name!r}"
            return runs[0]["id"], name
    finally:
        ctx.close()


def test_the_form_run_got_the_edited_parameter(stack):
    node, field, old, new = EDITED
    first, form = stack.runs["api"], stack.runs["form"]
    assert first["parameters"]["config"]["nodes"][node][field] == old
    assert form["parameters"]["config"]["nodes"][node][field] == new
    # nothing else moved: the form sent the deployment's parameters back as they were
    a, b = json.loads(json.dumps(first["parameters"])), json.loads(json.dumps(form["parameters"]))
    b["config"]["nodes"][node][field] = old
    assert a == b


# --- Prefect: the flow run ----------------------------------------------------------------------------


def test_task_runs_are_named_after_the_nodes_and_the_unchanged_node_is_cached(stack, browser):
    run = stack.runs["form"]
    states = {t["name"]: t["state_name"] for t in stack.api.task_runs(run["id"])}
    assert states == {"prep": "Cached", "sft": "Completed", "evaluate": "Completed"}, states
    ctx, page = new_page(browser)
    try:
        page.goto(f"{stack.prefect}/runs/flow-run/{run['id']}")
        page.get_by_text(run["name"], exact=True).first.wait_for()
        page.wait_for_load_state("networkidle")
        shot(page, "04-flow-run-graph")  # the graph is a canvas: its node labels are checked by eye
        _tab(page, "Task Runs").click()
        rows = page.locator(".task-run-list-item")
        rows.first.wait_for()
        page.wait_for_load_state("networkidle")
        shot(page, "05-task-runs")
        listed = {}
        for i in range(rows.count()):
            row = rows.nth(i)
            listed[row.get_by_role("link").first.inner_text().strip()] = row.locator(".state-badge").inner_text().strip()
        assert listed == {"prep": "Cached", "sft": "Completed", "evaluate": "Completed"}, \
            f"task runs listed in the UI: {listed}; the tab says:\n{page.locator('main, body').first.inner_text()[:2000]}"
    finally:
        ctx.close()


def _tab(page, name: str):
    tab = page.get_by_role("tab", name=name, exact=True)
    return tab if tab.count() else page.get_by_text(name, exact=True).first


def _summary_page(stack, browser, run_key: str, name_prefix: str):
    """(context, page) on the flow run's summary artifact, reached from its Artifacts tab."""
    run = stack.runs[run_key]
    ctx, page = new_page(browser)
    page.goto(f"{stack.prefect}/runs/flow-run/{run['id']}")
    page.get_by_text(run["name"], exact=True).first.wait_for()
    _tab(page, "Artifacts").click()
    card = page.get_by_text(f"{PIPELINE}-summary", exact=True).first
    card.wait_for()
    page.wait_for_load_state("networkidle")
    shot(page, f"{name_prefix}-artifacts-tab")
    card.click()
    page.wait_for_url(re.compile(r"/artifacts/artifact/"))
    page.get_by_role("heading", name=PIPELINE, exact=True).wait_for()
    page.wait_for_load_state("networkidle")
    shot(page, f"{name_prefix}-summary-artifact")
    return ctx, page


def test_the_run_artifact_summarizes_every_node_and_links_to_this_mlflow(stack, browser):
    ctx, page = _summary_page(stack, browser, "form", "06")
    try:
        table = page.locator("table")
        for node, status in [("prep", "cached"), ("sft", "ran"), ("evaluate", "ran")]:
            row = table.locator("tr").filter(has=page.get_by_role("cell", name=node, exact=True))
            assert row.count() == 1, f"no row for node {node} in the summary table"
            assert status in row.inner_text(), f"{node}: {row.inner_text()!r}"
        links = [(a.inner_text().strip(), a.get_attribute("href") or "") for a in page.locator("article a, .markdown-renderer a").all()]
        mlflow_links = [(t, h) for t, h in links if h.startswith(stack.mlflow)]
        assert mlflow_links, f"no link to {stack.mlflow} in the artifact: {links}"
        others = [h for _, h in links if h.startswith("http") and not h.startswith(stack.mlflow)]
        assert not others, f"links to an MLflow other than this `posttrain ui`'s: {others}"
        assert any(f"/#/models/{MODEL}/versions/" in h for _, h in mlflow_links), mlflow_links

        # the pipeline's parent run, followed as a user would (it opens a new tab)
        parent = page.get_by_role("link", name=re.compile(r"^[0-9a-f]{12}$")).first
        with ctx.expect_page() as popup:
            parent.click()
        ml = popup.value
        ml.get_by_text(f"{PIPELINE} ({stack.runs['form']['name']})").first.wait_for()
        _close_assistant(ml)
        # the cached node has a child run of its own in this pipeline run, linked to the original
        ml.get_by_text("prep (cached)").first.wait_for(timeout=30_000)
        shot(ml, "07-mlflow-pipeline-run")
    finally:
        ctx.close()


# --- MLflow ---------------------------------------------------------------------------------------


def _close_assistant(page) -> None:
    """MLflow 3.17 opens its Assistant panel on every page, a third of the width: close it."""
    close = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    try:
        close.first.click(timeout=5000)
    except Exception:  # noqa: BLE001 - not there (another MLflow): nothing to close
        pass


def _mlflow_search(stack, body: dict) -> list[dict]:
    req = urllib.request.Request(f"{stack.mlflow}/api/2.0/mlflow/runs/search", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    return json.loads(urllib.request.urlopen(req, timeout=30).read()).get("runs", [])


def _experiment_id(stack) -> str:
    q = urllib.parse.urlencode({"experiment_name": EXPERIMENT})
    with urllib.request.urlopen(f"{stack.mlflow}/api/2.0/mlflow/experiments/get-by-name?{q}", timeout=30) as r:
        return json.loads(r.read())["experiment"]["experiment_id"]


def test_registered_model_shows_both_versions_with_their_aliases(stack, browser):
    ctx, page = _summary_page(stack, browser, "form", "08")
    try:
        link = page.get_by_role("link", name=re.compile(rf"^{MODEL} v\d+$"))
        version = link.inner_text().rsplit("v", 1)[1]
        with ctx.expect_page() as popup:
            link.click()
        ml = popup.value
        ml.get_by_role("heading", name=f"Version {version}").wait_for()
        ml.get_by_text("@ candidate").or_(ml.get_by_text("candidate", exact=True)).first.wait_for()
        _close_assistant(ml)
        shot(ml, "09-mlflow-model-version")
        ml.get_by_role("link", name=MODEL, exact=True).first.click()
        ml.wait_for_url(re.compile(rf"#/models/{MODEL}$"))
        rows = ml.get_by_role("row")
        v1, v2 = rows.filter(has_text="Version 1"), rows.filter(has_text="Version 2")
        v1.first.wait_for()
        shot(ml, "10-mlflow-registered-model")
        # the first run (no champion yet) became champion; the second, no better, is candidate
        assert "champion" in v1.first.inner_text(), v1.first.inner_text()
        assert "candidate" in v2.first.inner_text(), v2.first.inner_text()
    finally:
        ctx.close()




def test_the_experiment_opens_on_the_runs_table(stack, browser):
    """The experiment link of the run's summary opens MLflow's runs table with the pipeline run in it,
    and the parent-run link a training run's page (metrics), not the GenAI views. (MLflow 3.17
    chooses its views from a sidebar switch whose default is GenAI; the experiment's
    mlflow.experimentKind tag is not consulted while that switch exists, so posttrain's links carry
    ?workflowType=machine_learning: posttrain.flows.report.ML_VIEW. A bare #/experiments/<id> typed by hand
    still opens the GenAI overview until the user flips the switch.)"""
    exp = _experiment_id(stack)
    ctx, page = _summary_page(stack, browser, "form", "11")
    try:
        link = page.get_by_role("link", name=EXPERIMENT, exact=True).first
        with ctx.expect_page() as popup:
            link.click()
        ml = popup.value
        ml.wait_for_url(re.compile(rf"#/experiments/{exp}/runs"))
        ml.get_by_text(f"{PIPELINE} ({stack.runs['form']['name']})").first.wait_for()
        _close_assistant(ml)
        ml.get_by_text("Run Name", exact=True).first.wait_for(timeout=30_000)  # the runs table's header
        shot(ml, "12-mlflow-experiment-runs-table")  # (MLflow polls: no network idle to wait for)
        assert "workflowType=machine_learning" in ml.url, ml.url
    finally:
        ctx.close()


def test_the_evaluate_comparison_shows_one_value_per_model(stack, browser):
    exp = _experiment_id(stack)
    flow_run = stack.runs["form"]
    parent = _mlflow_search(stack, {"experiment_ids": [exp], "filter": (
        f"tags.`prefect.flow_run_id` = '{flow_run['id']}'")})
    top = [r for r in parent if not any(t["key"] == "mlflow.parentRunId" for t in r["data"].get("tags", []))]
    assert top, "no MLflow pipeline run tagged with the flow run's id"
    nodes = _mlflow_search(stack, {"experiment_ids": [exp], "filter": (
        f"tags.mlflow.parentRunId = '{top[0]['info']['run_id']}'")})
    evaluate = [r for r in nodes if r["info"]["run_name"] == "evaluate"]
    assert evaluate, f"no evaluate child run: {[r['info']['run_name'] for r in nodes]}"
    per_model = _mlflow_search(stack, {"experiment_ids": [exp], "filter": (
        f"tags.mlflow.parentRunId = '{evaluate[0]['info']['run_id']}'")})
    models = json.loads((Path(stack.workdir) / "runs" / PIPELINE / "evaluate" / "results.json").read_text())["order"]
    assert len(per_model) == len(models), f"{len(per_model)} runs under evaluate for models {models}"
    ids = json.dumps([r["info"]["run_id"] for r in per_model])
    ctx, page = new_page(browser)
    try:
        page.goto(f"{stack.mlflow}/#/compare-runs?runs={urllib.parse.quote(ids)}&experiments="
                  f"{urllib.parse.quote(json.dumps([exp]))}")
        page.get_by_text(f"Comparing {len(models)} Runs").wait_for()
        _close_assistant(page)
        for name in models:
            page.get_by_text(f"evaluate/{name}", exact=True).first.wait_for()
        metric = page.get_by_text("exact_match", exact=True)
        metric.last.scroll_into_view_if_needed()
        shot(page, "13-mlflow-evaluate-comparison")
        # the metrics table's exact_match row holds one value per compared run: read by layout (the
        # leaf elements to the right of the metric's name, on its line), whatever the table's DOM
        rows = [m.evaluate("""el => { const r = el.getBoundingClientRect(), y = r.top + r.height / 2, out = [];
            for (const n of document.querySelectorAll('body *')) {
                if (n.children.length) continue;
                const b = n.getBoundingClientRect();
                if (b.width && b.left >= r.right && Math.abs(b.top + b.height / 2 - y) < 8) out.push((n.innerText || n.textContent || '').trim());
            } return out.filter(Boolean); }""") for m in metric.all()]
        values = [[c for c in row if re.fullmatch(r"-?[0-9.]+(e-?[0-9]+)?", c)] for row in rows]
        assert any(len(v) == len(models) for v in values), f"exact_match rows: {rows} for models {models}"
    finally:
        ctx.close()


def test_the_registered_version_has_a_signature_and_lineage_links(stack, browser):
    ctx, page = new_page(browser)
    try:
        page.goto(f"{stack.mlflow}/#/models/{MODEL}/versions/2")
        page.get_by_role("heading", name="Version 2").wait_for()
        _close_assistant(page)
        schema = page.get_by_text(re.compile(r"^Inputs \(\d+\)$"))
        schema.first.wait_for()
        schema.first.click()  # expand the inputs
        schema.first.scroll_into_view_if_needed()
        shot(page, "14-mlflow-version-signature")
        assert schema.first.inner_text() != "Inputs (0)", "the version has no signature"
        page.get_by_text(re.compile(r"^prompt\b")).first.wait_for(timeout=10_000)  # "prompt (required)"
        # lineage: the run it came from, and the logged model it is
        hrefs = [a.get_attribute("href") or "" for a in page.locator("a").all()]
        assert any(re.search(r"/runs/[0-9a-f]{32}", h) for h in hrefs), f"no link to the source run: {hrefs}"
        assert any(re.search(r"/models/m-[0-9a-f]+", h) for h in hrefs), f"no link to a logged model: {hrefs}"
    finally:
        ctx.close()
