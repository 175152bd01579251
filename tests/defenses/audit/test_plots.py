"""The trade-off point every arm is drawn as (defenses.tradeoff_points)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from defenses.results import UNDEFENDED, Summary
from defenses.tradeoff_points import draw_arm_point


def test_arm_point_sits_at_the_means_with_std_bars():
    fig, ax = plt.subplots()
    try:
        x, y = Summary(0.9, 0.01, 3), Summary(0.6, 0.05, 3)
        assert draw_arm_point(ax, UNDEFENDED, x, y, "none")
        assert draw_arm_point(ax, "rps", y, x, None)
        assert not draw_arm_point(ax, "ssd", x, None, "ssd")
        star, dot = ax.containers
        line = star.lines[0]
        assert np.allclose(line.get_xydata(), [[0.9, 0.6]])
        assert line.get_marker() == "*"
        assert dot.lines[0].get_marker() == "o"
        assert line.get_markersize() == 12
        assert dot.lines[0].get_markersize() == 6
        assert [t.get_text() for t in ax.legend().get_texts()] == ["none"]
    finally:
        plt.close(fig)
