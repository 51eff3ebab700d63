"""Writes the small Parquet datasets the data-loading tests read (tests/fixtures/data/).

    /opt/peers/venv/bin/python scripts/make_parquet_fixtures.py

prompts.parquet (snappy, as pandas/HF datasets write by default): a string prompt, an int64 answer
and a float metadata column, with a null prompt in row 3. chat.parquet (gzip): the prompt as a list
of {role, content} messages, as HF chat datasets store it. nested.parquet: a struct column (see below). wrong_types.parquet: a prompt column of int64 and a messages
column of strings, for the bad-input corpus.
"""
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "data"
out.mkdir(parents=True, exist_ok=True)

pq.write_table(
    pa.table({
        "question": ["What is 2 + 3?", "What is 10 + 7?", None, "What is 40 + 2?"],
        "answer": pa.array([5, 17, 1, 42], type=pa.int64()),
        "difficulty": [0.1, 0.2, 0.3, 0.4],
    }),
    out / "prompts.parquet",
    compression="snappy",
)

msg = pa.struct([("role", pa.string()), ("content", pa.string())])
pq.write_table(
    pa.table({
        "messages": pa.array([
            [{"role": "system", "content": "Answer with a number."},
             {"role": "user", "content": "What is 6 * 7?"}],
            [{"role": "user", "content": "What is 9 - 4?"}],
        ], type=pa.list_(msg)),
        "answer": ["42", "5"],
    }),
    out / "chat.parquet",
    compression="gzip",
)
# The bad-input corpus: a prompt column of integers and a messages column of plain strings.
pq.write_table(
    pa.table({
        "prompt": pa.array([1, 2], type=pa.int64()),
        "messages": pa.array([["a", "b"], ["c"]], type=pa.list_(pa.string())),
        "answer": ["1", "2"],
    }),
    out / "wrong_types.parquet",
)
print("wrote", sorted(p.name for p in out.glob("*.parquet")))

# nested.parquet (snappy): prompts nested in a record, as RealToxicityPrompts stores them
# ({"prompt": {"text": ..., "toxicity": ...}}), read with prompt_field = "prompt.text".
pq.write_table(
    pa.table({
        "filename": ["a.txt", "b.txt"],
        "prompt": pa.array(
            [{"text": "So I said", "toxicity": 0.1}, {"text": "Then they", "toxicity": 0.7}],
            type=pa.struct([("text", pa.string()), ("toxicity", pa.float64())]),
        ),
    }),
    out / "nested.parquet",
    compression="snappy",
)
