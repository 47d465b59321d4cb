"""The generative judge's template and parsers: a template without the response, or with an unknown placeholder,
is refused naming the key and the fix; verdicts parse to a number or to None (unreadable), never raise."""

import pytest

from mcore_rl.rewards.judge import JudgeError, Verdicts, load_template, score_tag, yes_no


def test_templates_need_the_response_and_known_placeholders(tmp_path):
    assert load_template("Grade: {response}") == "Grade: {response}"
    (tmp_path / "t.txt").write_text('Q: {question}\nA: {response}\nReference: {answer}\nJSON: {{"ok": 1}}')
    assert load_template(str(tmp_path / "t.txt")).startswith("Q: {question}")
    with pytest.raises(JudgeError, match=r"models.judge.template: no \{response\} placeholder"):
        load_template("Is {question} right?")
    with pytest.raises(JudgeError, match=r"unknown placeholder\(s\) \['reply'\]; expected"):
        load_template("{response} vs {reply}")


@pytest.mark.parametrize(
    ("text", "tag", "word"),
    [
        ("<score>7</score>", 7.0, None),
        ("I think <score> 3.5 </score> then <score>-2</score>", -2.0, None),
        ("Yes, it is right.", None, 1.0),
        ("no.", None, 0.0),
        ("  **YES**", None, 1.0),
        ("yesterday <score>x</score>", None, None),
        ("", None, None),
        ("<score>" * 10000 + "1", None, None),  # long hostile text: linear-time, unreadable
    ],
)
def test_parsers_read_a_number_or_nothing(text, tag, word):
    assert score_tag(text) == tag and yes_no(text) == word


def test_a_users_parser_reads_numbers_and_nothing_else(tmp_path):
    """A user's parser (models.judge.parser: file.py:function): numbers pass, None and a raise are unreadable
    verdicts, anything else is its bug, named with the sample; a file without the function is refused by key."""
    (tmp_path / "p.py").write_text(
        "def parse(v):\n"
        "    if v == 'boom':\n        raise ValueError(v)\n"
        "    if v == 'word':\n        return 'seven'\n"
        "    return None if v == '?' else int(v)\n"
    )
    verdicts = Verdicts(f"{tmp_path}/p.py:parse")
    assert verdicts.score([("s0", "7"), ("s1", "?"), ("s2", "boom")]) == [7.0, None, None]
    with pytest.raises(JudgeError, match=r"parser='.*p.py:parse' returned 'seven' \(str\) on the verdict of sample s3"):
        verdicts.score([("s3", "word")])
    with pytest.raises(JudgeError, match=r"models.judge.parser='.*p.py:other': .*p.py has no 'other'; define a funct"):
        Verdicts(f"{tmp_path}/p.py:other")
