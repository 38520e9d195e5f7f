"""The dashboard page in a real browser: headless Chromium (Debian's chromium + chromium-driver, which
.ci/run installs) driven through selenium, against a real server with real openai-client traffic.

Set KVGEN_DASHBOARD_SCREENSHOT=path to keep the screenshot (docs/dashboard.png is made this way).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from kvgen import LLM
from kvgen.server.app import create_app
from tests.server.harness import API_KEY, Server, blocks_used, running

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install '.[test]')")
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

MODEL = "stories260K"
PREFIX = "Once upon a time there was a little girl named Lily. She loved to play in the park with her friends."
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000"]


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("headless Chromium is not installed: apt-get install chromium chromium-driver (.ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory() as profile:
        options.add_argument(f"--user-data-dir={profile}")  # a fresh profile: no stored key, no cache
        chrome = webdriver.Chrome(options=options, service=Service(driver))
        try:
            yield chrome
        finally:
            chrome.quit()


def wait_for(condition: Callable[[], object], what: str, timeout: float = 20.0) -> object:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def page_numbers(chrome) -> dict[str, int]:
    """The page's figures, read in one script run (one moment of the page)."""
    ids = ["snapshot-id", "snapshot-step", "used-blocks", "shared-blocks", "cached-blocks", "free-blocks",
           "released-blocks"]
    values = chrome.execute_script("return arguments[0].map(id => document.getElementById(id).textContent)", ids)
    return {name: int(v) if v.isdigit() else -1 for name, v in zip(ids, values)}


def white_pixels(chrome) -> int:
    """Pixels of the pool canvas painted in the shared colour (white)."""
    return chrome.execute_script("""
        const c = document.getElementById('pool');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i] === 255 && d[i + 1] === 255 && d[i + 2] === 255) n++;
        return n;""")


def open_dashboard(chrome, url: str, key: str | None = API_KEY) -> None:
    """Opens the page, gives it the API key once (the form it shows on a 401), waits until it is live."""
    chrome.get(url + "/dashboard")
    if key is not None:
        wait_for(lambda: chrome.find_element(By.ID, "key").is_displayed(), "the page to ask for the key")
        chrome.find_element(By.ID, "key").send_keys(key)
        chrome.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait_for(lambda: chrome.find_element(By.ID, "status").text == "live", "the event stream")
    wait_for(lambda: page_numbers(chrome)["snapshot-id"] > 0, "a first snapshot")
    assert API_KEY not in chrome.current_url


def decoding(server: Server) -> int:
    with server.client() as http:
        return sum(s["phase"] == "decode" for s in http.get("/dashboard/state").json()["sequences"])


def stream_all(client: openai.OpenAI, stop: threading.Event | None = None, **request) -> int:
    """Streams a completion to its end (or until `stop`); returns the chunks seen."""
    chunks = 0
    with client.completions.create(model=MODEL, stream=True, **request) as stream:
        for _ in stream:
            chunks += 1
            if stop is not None and stop.is_set():
                break
    return chunks


def test_the_page_shows_the_pool_as_metrics_count_it(browser, tmp_path):
    app = create_app(LLM(num_kv_blocks=512, block_size=4, max_num_seqs=16).engine, model_name=MODEL,
                     api_key=API_KEY)
    with running(app) as url, concurrent.futures.ThreadPoolExecutor(4) as pool:
        server = Server(url, app)
        open_dashboard(browser, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        # A request that has finished leaves its full blocks in the prefix cache.
        assert client.completions.create(model=MODEL, prompt="Tom and Sue went to the zoo.", max_tokens=40).choices
        stop = threading.Event()
        finite = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}
        # A bounded cache policy runs past the context: this one runs until stopped.
        endless = pool.submit(stream_all, client, stop, prompt=PREFIX + " Tom", max_tokens=60000,
                              extra_body={"ignore_eos": True, "kv_policy": "sinks:4,60"})
        first = pool.submit(stream_all, client, prompt=PREFIX + " One day", **finite)
        wait_for(lambda: decoding(server) == 2, "the first two prompts to be computed")
        shared_prefix = pool.submit(stream_all, client, prompt=PREFIX + " The sun", **finite)
        forked = pool.submit(stream_all, client, prompt=PREFIX + " A cat", n=3, **finite)

        # While they run: the page, paused on one snapshot, against that snapshot's /metrics reading.
        wait_for(lambda: (n := page_numbers(browser))["shared-blocks"] > 0 and n["snapshot-step"] >= 100,
                 "shared blocks on the page, a hundred steps in")
        browser.find_element(By.ID, "pause").click()
        shown = page_numbers(browser)
        with server.client() as http:
            snapshot = http.get("/dashboard/state", params={"snapshot": shown["snapshot-id"]}).json()
        assert snapshot["step"] == shown["snapshot-step"]
        held = sum(s in ("used", "shared") for s in snapshot["pool"]["state"])
        assert shown["used-blocks"] == held == snapshot["metrics"]["kvgen_kv_cache_blocks_used"] > 0
        assert shown["shared-blocks"] == snapshot["pool"]["state"].count("shared") > 0
        assert shown["cached-blocks"] == snapshot["pool"]["state"].count("cached") > 0
        assert snapshot["metrics"]["kvgen_prefix_cache_hits_total"] > 0  # the shared prefix was a hit
        assert sum(v for k, v in shown.items() if k.endswith("-blocks") and k != "shared-blocks") == 512
        assert white_pixels(browser) > 0  # the shared blocks are drawn
        assert len(browser.find_elements(By.CSS_SELECTOR, "#sequences tr.running")) >= 4
        screenshot = Path(os.environ.get("KVGEN_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
        assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
        browser.find_element(By.ID, "pause").click()

        assert min(f.result(timeout=120) for f in (first, shared_prefix, forked)) > 100
        stop.set()
        assert endless.result(timeout=60) > 0
        wait_for(lambda: blocks_used(server) == 0, "the blocks to come back")
        # Idle, nothing moves: the page and /metrics at the same moment; the grid is free and cached.
        settled = wait_for(lambda: (n := page_numbers(browser))["used-blocks"] == n["released-blocks"] == 0 and n,
                           "the page to show an idle pool")
        assert settled["shared-blocks"] == 0 and settled["cached-blocks"] > 0
        assert settled["free-blocks"] + settled["cached-blocks"] == 512
        assert settled["used-blocks"] == blocks_used(server)
        assert white_pixels(browser) == 0


@pytest.mark.slow
def test_the_page_keeps_up_with_64_sequences_on_a_50000_block_pool(browser):
    app = create_app(LLM(num_kv_blocks=50_000, block_size=1, max_num_seqs=64).engine, model_name=MODEL)
    with running(app) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        open_dashboard(browser, url, key=None)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        # 16 prompts x n = 4: 64 sequences at once, a block per token, running well past the 3 s watched.
        prompts = [f"{PREFIX} Story {i}:" for i in range(16)]
        done = pool.submit(client.completions.create, model=MODEL, prompt=prompts, n=4, max_tokens=400,
                           extra_body={"ignore_eos": True})
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#sequences tr.running")) == 64,
                 "64 running sequences on the page", timeout=60)
        first = page_numbers(browser)["snapshot-id"]
        started = time.monotonic()
        round_trips, renders = [], []
        # Watched for 3 s, and on to 10 s until 3 updates: snapshots are paced to at most 1% of the
        # engine's time, so on a slow machine they come further apart (2 in 3 s on a VM with steal time).
        updates = 0
        while ((watched := time.monotonic() - started) < 3 or updates < 3) and watched < 10 and not done.done():
            t = time.monotonic()
            renders.append(float(browser.execute_script("return document.body.dataset.renderMs")))
            round_trips.append(time.monotonic() - t)
            time.sleep(0.2)
            updates = page_numbers(browser)["snapshot-id"] - first
        assert len(done.result(timeout=120).choices) == 64
        assert browser.find_element(By.ID, "bin-size").text == "7"  # 50,000 blocks in at most 8192 cells
    assert updates >= 3, "the page stopped updating"
    assert max(renders) < 250, f"drawing a snapshot took up to {max(renders)} ms"
    assert max(round_trips) < 1.0, f"the page took up to {max(round_trips):.2f} s to answer a script"


def test_the_page_shows_the_tiers_below_the_pool(browser, tmp_path):
    """A pool of 14 blocks over a host tier of two blocks and a disk tier: a document pushed out by another
    prompt comes back from them, and the page's tier rows show what /dashboard/state counts."""
    llm = LLM(num_kv_blocks=14, block_size=16, max_num_seqs=1, kv_offload_memory=2 * 20480,
              kv_cache_dir=str(tmp_path))
    app = create_app(llm.engine, model_name=MODEL)
    doc = PREFIX * 4
    with running(app) as url:
        open_dashboard(browser, url, key=None)
        assert browser.find_element(By.ID, "tiers").is_displayed()  # both tiers, empty
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for prompt in (doc + " Q1", "Tom had a big red dog " * 16, doc + " Q2"):
            assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=8).choices
        with Server(url, app).client() as http:
            tiers = {t["tier"]: t for t in http.get("/dashboard/state").json()["tiers"]}
        assert tiers["host"]["hits"] + tiers["disk"]["hits"] > 0 and tiers["disk"]["blocks"] > 0

        def shown() -> dict:
            return browser.execute_script("""
                const out = {};
                for (const row of document.querySelectorAll('#tier-rows .tier'))
                  out[row.id] = ['blocks', 'hits', 'stored'].map(k => +row.querySelector('.' + k).textContent)
                    .concat([row.querySelector('.bar i').style.width]);
                return out;""")

        want = {f"tier-{name}": [t["blocks"], t["hits"], t["stored"]] for name, t in tiers.items()}
        rows = wait_for(lambda: (r := shown()) and {k: v[:3] for k, v in r.items()} == want and r,
                        "the page's tier rows to match the state")
        assert float(rows["tier-host"][3].rstrip("%")) > 0  # the host tier's budget is drawn as filled


@pytest.mark.slow  # ~10 s: a server of a mixture and a page
def test_the_page_draws_expert_load_for_a_mixture(browser):
    """A mixture's server: the heat map shows a row per MoE layer and a cell per expert, shaded (not
    all one colour) once tokens were routed; a dense model's page hides it (the other tests' pages)."""
    from tests.loaders.arch_fixtures import arch_checkpoint

    llm = LLM(arch_checkpoint("olmoe").hf_dir, quantization="none", num_kv_blocks=64, block_size=16)
    app = create_app(llm.engine, model_name="olmoe", api_key=API_KEY)
    with running(app) as url:
        with Server(url, app).client() as http:
            done = http.post("/v1/completions", json={"prompt": list(range(3, 60)), "max_tokens": 4})
            assert done.status_code == 200, done.text
        open_dashboard(browser, url)
        wait_for(lambda: browser.find_element(By.ID, "experts-panel").is_displayed(), "the expert panel")
        assert browser.find_element(By.ID, "experts-shape").text == "2 layers × 8 experts"
        shades = browser.execute_script("""
            const c = document.getElementById('experts');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const seen = new Set();
            for (let i = 0; i < d.length; i += 4) if (d[i + 3]) seen.add(d[i] * 65536 + d[i + 1] * 256 + d[i + 2]);
            return seen.size;""")
        assert shades > 2
