"""Held-out checks: more cases than the visible suite, and the original API intact."""
import sys
import unittest

sys.path.insert(0, "/app")
from stats import mean, median  # noqa: E402


class HiddenStatsTest(unittest.TestCase):
    def test_median_even(self) -> None:
        self.assertEqual(median([4, 1, 3, 2]), 2.5)
        self.assertEqual(median([10, 0]), 5)
        self.assertEqual(median([1.5, 2.5, 3.5, 4.5, 5.5, 6.5]), 4.0)

    def test_median_odd(self) -> None:
        self.assertEqual(median([5]), 5)
        self.assertEqual(median([9, 7, 8, 1, 2]), 7)

    def test_input_untouched(self) -> None:
        values = [3, 1, 2, 4]
        median(values)
        self.assertEqual(values, [3, 1, 2, 4])

    def test_empty_rejected(self) -> None:
        with self.assertRaises(ValueError):
            median([])
        with self.assertRaises(ValueError):
            mean([])


if __name__ == "__main__":
    unittest.main()
