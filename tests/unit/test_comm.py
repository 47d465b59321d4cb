"""The byte bucketing every streamed transfer uses (the export's gathers, the engine's loads, the adapters)."""

from parallel.comm import byte_buckets


def test_byte_buckets_keep_order_fill_to_the_budget_and_split_where_the_key_changes():
    items = [("a", 3), ("a", 3), ("a", 5), ("b", 1), ("b", 9), ("b", 1)]
    size = lambda item: item[1]  # noqa: E731
    assert list(byte_buckets(items, size, 6)) == [items[0:2], [items[2], items[3]], [items[4]], [items[5]]]
    by_key = list(byte_buckets(items, size, 100, key=lambda item: item[0]))
    assert by_key == [items[0:3], items[3:6]]  # never mixed: e.g. two pipeline owners or dtypes
    assert list(byte_buckets([], size, 6)) == []
