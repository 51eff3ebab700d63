"""A reward with a spread on any text, for random-weight models (they never answer right): the
share of a completion's characters that are vowels or digits. Both trainers score with it in the
long-completion benchmark (bench/long_step.sh), so every group has a spread and both do a full
update."""


def varied(completions, **kwargs):
    scores = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) and c else (c if isinstance(c, str) else "")
        scores.append(sum(ch in "aeiou0123456789" for ch in text) / max(len(text), 1))
    return scores
