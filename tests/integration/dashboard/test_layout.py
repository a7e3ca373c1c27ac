"""The dashboard's layout in a real browser: the heat map fills the width with labelled axes
and distinct outlines, the speed chart reads in plain numbers over labelled time, and the
chat is greedy by default and its Stop ends an answer mid-way."""


import httpx2 as httpx
import pytest

from tests.integration.dashboard.page_parts import auth, client, open_with_key, wait_for

pytestmark = pytest.mark.slow


def test_the_heat_map_fills_the_width_with_labelled_axes_and_distinct_outlines(page, server):
    client(server).completions.create(model="tiny", prompt="axes", max_tokens=4, temperature=0)
    open_with_key(page, server)
    page.wait_for_function("window.shoalDashboard.heatCells() > 0", timeout=15_000)
    widths = page.evaluate("""() => [document.getElementById('heat-map').width,
                                      document.getElementById('heat').clientWidth]""")
    assert widths[0] >= 0.85 * widths[1], widths  # not half the section
    labels = page.evaluate("window.shoalDashboard.heatLabels()")
    layers = page.evaluate("window.shoalDashboard.heatLayers()")
    assert labels["experts"][0] == 0 and labels["layers"] == layers  # every layer named
    first = page.evaluate("(l) => window.shoalDashboard.heatCell(l, 0)", layers[0])
    # the label column left of the first cell holds drawn text
    inked = page.evaluate("""(c) => { const d = document.getElementById('heat-map')
        .getContext('2d').getImageData(0, Math.floor(c.y) - 5, Math.floor(c.x) - 4, 10).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }""", first)
    assert inked > 5
    colours = page.evaluate("window.shoalDashboard.workerColours()")

    def rgb(hex_colour: str) -> tuple[int, ...]:
        return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))

    def distance(a, b) -> float:
        return sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) ** 0.5

    shown = [rgb(c) for c in colours[:6]]  # up to six workers: each told apart at a glance
    assert min(distance(a, b) for i, a in enumerate(shown) for b in shown[i + 1:]) > 120
    legend = page.evaluate("""[...document.querySelectorAll('#heat-workers i')]
        .map(i => getComputedStyle(i).backgroundColor)""")
    assert legend[:2] == [f"rgb({', '.join(map(str, rgb(c)))})" for c in colours[:2]]


def test_the_speed_chart_reads_in_plain_numbers_over_labelled_time(page, server):
    open_with_key(page, server)
    page.wait_for_selector(".card.worker", timeout=10_000)
    short = page.evaluate("[86800, 1234567, 0.25, 12].map(window.shoalDashboard.shortNumber)")
    assert short == ["86.8k", "1.23M", "0.25", "12"]
    # the strip under the plot holds the time labels (the plot never reaches it)
    wait_for(lambda: page.evaluate("""() => { const c = document.getElementById('tps-chart');
        const d = c.getContext('2d').getImageData(0, c.height - 12, c.width, 12).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }""") > 20,
             10, "time labels under the chart")


def test_the_chat_is_greedy_by_default_and_stop_ends_an_answer_mid_way(page, server):
    open_with_key(page, server)
    page.wait_for_selector(".card.worker", timeout=10_000)
    assert page.input_value("#chat-temperature") == "0"  # greedy: the exact answer
    assert page.is_disabled("#chat-stop")
    page.fill("#chat-max", "4000")
    page.fill("#chat-input", "Tell me a very long story")
    page.click("#chat-send")
    page.wait_for_function("Number(document.querySelector('.message.assistant')"
                           ".textContent.length) > 0", timeout=60_000)
    page.click("#chat-stop")
    page.wait_for_selector(".message.assistant[data-done='true']", timeout=30_000)
    assert page.get_attribute(".message.assistant", "data-stopped") == "true"
    mark = page.evaluate("getComputedStyle(document.querySelector('.message.assistant'), "
                         "'::after').content")
    assert "[stopped]" in mark  # seen on the page, not only in an attribute
    assert page.is_enabled("#chat-send") and page.is_disabled("#chat-stop")
    wait_for(lambda: httpx.get(server.url + "/health", headers=auth(), timeout=10)
             .json()["requests_in_flight"] == 0, 15, "the stopped request dropped")
