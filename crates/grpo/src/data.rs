//! Prompt datasets: rows from JSONL or CSV files (field names configurable) or the built-in
//! arithmetic task; the chat template applied to each prompt; a seeded, resumable prompt order.

use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::{Map, Value};

use crate::{Error, Result};
use grpo_models::tokenizer::{ChatMessage, Tokenizer};

/// Raw rows of a file: (line number, the row's fields or why it is unusable).
type RawRows = Vec<(usize, std::result::Result<Map<String, Value>, String>)>;

/// A prompt: plain text (sent as one user message when the model has a chat template) or a
/// conversation.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Messages(Vec<ChatMessage>),
}

/// One dataset row.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub prompt: Prompt,
    /// Reference answer (numbers converted to text), passed to rewards.
    pub answer: Option<String>,
    /// Every other field of the row, passed to rewards.
    pub metadata: Map<String, Value>,
    /// Where the row came from (`file.jsonl:17`, `arithmetic:train:5`), for messages.
    pub origin: String,
    /// The prompt's token ids when they are fixed already (a held-out fill-in input masked on
    /// the fly): used as they are instead of tokenizing `prompt`.
    pub tokens: Option<Vec<u32>>,
}

/// Which fields hold what.
#[derive(Debug, Clone)]
pub struct DataFields {
    pub prompt_field: String,
    pub answer_field: String,
    pub skip_bad_rows: bool,
}

/// Rows read from a file, and the ones skipped (with `skip_bad_rows`).
#[derive(Debug, Clone)]
pub struct Loaded {
    pub examples: Vec<Example>,
    /// One reason per skipped row: `file:line: why`.
    pub skipped: Vec<String>,
}

/// The prompt as readable text (messages joined as `role: content`), for logs.
pub fn prompt_text(ex: &Example) -> String {
    match &ex.prompt {
        Prompt::Text(t) => t.clone(),
        Prompt::Messages(ms) => ms
            .iter()
            .map(|m| format!("{}: {}", m.role, m.content))
            .collect::<Vec<_>>()
            .join("\n"),
    }
}

/// Removes field `name` from `row`: the key itself when the row has it, else a dotted path into
/// nested records (`prompt.text` in `{"prompt": {"text": ...}}`, as RealToxicityPrompts stores
/// its prompts; JSONL and Parquet structs alike). The rest of a nested record stays in the row.
fn take_field(row: &mut Map<String, Value>, name: &str) -> Option<Value> {
    if let Some(v) = row.remove(name) {
        return Some(v);
    }
    let (head, rest) = name.split_once('.')?;
    match row.get_mut(head)? {
        Value::Object(inner) => take_field(inner, rest),
        _ => None,
    }
}

/// Converts one row (a JSON object) into an example; `Err` holds the reason.
fn row_to_example(
    row: Map<String, Value>,
    f: &DataFields,
    origin: String,
) -> std::result::Result<Example, String> {
    let mut row = row;
    let prompt = match take_field(&mut row, &f.prompt_field) {
        None => {
            return Err(format!(
                "no `{}` field (set prompt_field to the field holding the prompt)",
                f.prompt_field
            ))
        }
        Some(Value::String(s)) if s.trim().is_empty() => {
            return Err(format!("`{}` is empty", f.prompt_field))
        }
        Some(Value::String(s)) => {
            // A CSV cell may hold a JSON list of messages.
            match serde_json::from_str::<Value>(&s) {
                Ok(v @ Value::Array(_)) => messages(&v, &f.prompt_field)?,
                _ => Prompt::Text(s),
            }
        }
        Some(v @ Value::Array(_)) => messages(&v, &f.prompt_field)?,
        Some(Value::Null) => return Err(format!("`{}` is null", f.prompt_field)),
        Some(v) => {
            return Err(format!(
                "`{}` must be a string or a list of {{role, content}} messages, got {v}",
                f.prompt_field
            ))
        }
    };
    let answer = match take_field(&mut row, &f.answer_field) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(v @ (Value::Number(_) | Value::Bool(_))) => Some(v.to_string()),
        Some(v) => {
            return Err(format!(
                "`{}` must be a string or a number, got {v}",
                f.answer_field
            ))
        }
    };
    Ok(Example {
        prompt,
        answer,
        metadata: row,
        origin,
        tokens: None,
    })
}

fn messages(v: &Value, field: &str) -> std::result::Result<Prompt, String> {
    // Callers pass only lists.
    let items = v.as_array().map(Vec::as_slice).unwrap_or_default();
    if items.is_empty() {
        return Err(format!("`{field}` is an empty list of messages"));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let content = m.get("content").and_then(Value::as_str);
        match (role, content) {
            (Some(r), Some(c)) => out.push(ChatMessage::new(r, c)),
            _ => {
                return Err(format!(
                    "message {i} of `{field}` needs string `role` and `content`"
                ))
            }
        }
    }
    Ok(Prompt::Messages(out))
}

/// Reads a dataset file (by extension: JSONL, CSV, Parquet, text) into examples. A file name with
/// one `*` (`data/train-*.parquet`, a split stored in shards) reads every matching file of that
/// directory, in name order, as one dataset.
pub fn load_examples(path: &Path, fields: &DataFields) -> Result<Loaded> {
    let Some(pattern) = path
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| n.contains('*'))
    else {
        return load_file(path, fields);
    };
    let shards = matching_files(path, pattern)?;
    let mut all = Loaded {
        examples: Vec::new(),
        skipped: vec![],
    };
    for shard in shards {
        let one = load_file(&shard, fields)?;
        all.examples.extend(one.examples);
        all.skipped.extend(one.skipped);
    }
    Ok(all)
}

/// The files of `path`'s directory whose names match `pattern` (one `*`), sorted; an error names
/// the pattern when none does.
fn matching_files(path: &Path, pattern: &str) -> Result<Vec<std::path::PathBuf>> {
    let (head, tail) = match pattern.split_once('*') {
        Some((h, t)) if !t.contains('*') => (h, t),
        _ => {
            return Err(Error::file(
                path,
                "a dataset file name takes one `*` at most (e.g. data/train-*.parquet)",
            ))
        }
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::file(path, format!("cannot list {}: {e}", dir.display())))?;
    let mut files: Vec<std::path::PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|f| f.is_file())
        .filter(|f| {
            f.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.len() >= head.len() + tail.len() && n.starts_with(head) && n.ends_with(tail)
            })
        })
        .collect();
    if files.is_empty() {
        return Err(Error::file(path, "no file matches this pattern"));
    }
    files.sort();
    Ok(files)
}

/// Reads one dataset file (by extension) into examples.
fn load_file(path: &Path, fields: &DataFields) -> Result<Loaded> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let name = path.display().to_string();
    let rows: RawRows = match ext.as_str() {
        "jsonl" | "json" | "ndjson" => numbered_lines(path)?
            .into_iter()
            .map(|(n, l)| {
                let r = l.and_then(|l| match serde_json::from_str::<Value>(&l) {
                    Ok(Value::Object(m)) => Ok(m),
                    Ok(_) => Err("expected a JSON object".to_string()),
                    Err(e) => Err(format!("invalid JSON: {e}")),
                });
                (n, r)
            })
            .collect(),
        "csv" => {
            let mut rdr = csv::Reader::from_path(path)
                .map_err(|e| Error::file(path, format!("cannot read CSV: {e}")))?;
            let headers = rdr
                .headers()
                .map_err(|e| Error::file(path, format!("cannot read the CSV header: {e}")))?
                .clone();
            rdr.records()
                .enumerate()
                .map(|(i, rec)| {
                    let r = rec.map_err(|e| format!("bad CSV row: {e}")).map(|rec| {
                        headers
                            .iter()
                            .zip(rec.iter())
                            .map(|(h, v)| (h.to_string(), Value::String(v.to_string())))
                            .collect()
                    });
                    (i + 2, r)
                })
                .collect()
        }
        "parquet" => parquet_rows(path)?,
        // Plain text: one prompt per non-blank line (a fill-in corpus masked on the fly).
        "txt" | "text" => numbered_lines(path)?
            .into_iter()
            .map(|(n, l)| {
                let r = l.map(|l| {
                    let mut m = Map::new();
                    m.insert(
                        fields.prompt_field.clone(),
                        Value::String(l.trim_end().to_string()),
                    );
                    m
                });
                (n, r)
            })
            .collect(),
        _ => {
            return Err(Error::file(
                path,
                "unknown dataset format: use .jsonl, .csv, .parquet or .txt (one prompt per line)",
            ));
        }
    };
    rows_to_examples(rows, &name, fields, "line", |m| Error::file(path, m))
}

/// Rows in memory (a dataset the Python package was given), read as a file's rows are: `name`
/// (`train_dataset`) and the row's index name a bad row.
pub fn examples_from_rows(
    rows: Vec<Map<String, Value>>,
    name: &str,
    fields: &DataFields,
) -> Result<Loaded> {
    let rows: RawRows = rows
        .into_iter()
        .enumerate()
        .map(|(i, r)| (i, Ok(r)))
        .collect();
    rows_to_examples(rows, name, fields, "row", |m| Error::config(name, m))
}

/// Rows -> examples; a bad row is skipped (`skip_bad_rows`) or the error `err` makes, naming
/// the row as `{unit} {n}`.
fn rows_to_examples(
    rows: RawRows,
    name: &str,
    fields: &DataFields,
    unit: &str,
    err: impl Fn(String) -> Error,
) -> Result<Loaded> {
    let mut out = Loaded {
        examples: Vec::with_capacity(rows.len()),
        skipped: vec![],
    };
    for (line, r) in rows {
        let origin = format!("{name}:{line}");
        match r.and_then(|m| row_to_example(m, fields, origin.clone())) {
            Ok(ex) => out.examples.push(ex),
            Err(why) if fields.skip_bad_rows => out.skipped.push(format!("{origin}: {why}")),
            Err(why) => {
                return Err(err(format!(
                    "{unit} {line}: {why} (or set skip_bad_rows = true to skip such rows)"
                )))
            }
        }
    }
    if out.examples.is_empty() {
        return Err(err("no usable rows".into()));
    }
    Ok(out)
}

/// The longest line a dataset may hold: a prompt is at most a few hundred kB of text; a longer
/// line is a file that is not a dataset of prompts (a binary, a dump on one line).
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// The non-blank lines of a text file, numbered from 1; a line that is not UTF-8 or longer than
/// [`MAX_LINE_BYTES`] is that row's error.
fn numbered_lines(path: &Path) -> Result<Vec<(usize, std::result::Result<String, String>)>> {
    let bytes = std::fs::read(path).map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    Ok(bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, l)| !l.iter().all(u8::is_ascii_whitespace))
        .map(|(i, l)| {
            let line = if l.len() > MAX_LINE_BYTES {
                Err(format!(
                    "the line is {:.1} MB long; a row may be at most {} MB",
                    l.len() as f64 / 1e6,
                    MAX_LINE_BYTES >> 20
                ))
            } else {
                std::str::from_utf8(l)
                    .map(|t| t.trim_end_matches('\r').to_string())
                    .map_err(|e| {
                        format!(
                            "not valid UTF-8 (byte {} of the line); save the file as UTF-8",
                            e.valid_up_to() + 1
                        )
                    })
            };
            (i + 1, line)
        })
        .collect())
}

/// Rows of a Parquet file as JSON objects (lists of structs become lists of objects, so chat
/// messages arrive as messages). Numbered from 1, like data rows of a CSV.
fn parquet_rows(path: &Path) -> Result<RawRows> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let f =
        std::fs::File::open(path).map_err(|e| Error::file(path, format!("cannot open: {e}")))?;
    let reader = SerializedFileReader::new(f).map_err(|e| {
        Error::file(
            path,
            format!("not a readable Parquet file ({e}); snappy, gzip, lz4 and uncompressed files are supported"),
        )
    })?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| Error::file(path, format!("cannot read Parquet rows: {e}")))?;
    Ok(rows
        .enumerate()
        .map(|(i, row)| {
            let r = match row {
                Ok(row) => match row.to_json_value() {
                    Value::Object(m) => Ok(m),
                    v => Err(format!("expected a record, got {v}")),
                },
                Err(e) => Err(format!("bad Parquet row: {e}")),
            };
            (i + 1, r)
        })
        .collect())
}

/// Token ids of the prompt as the model sees it. With a chat template: the messages (a text
/// prompt is one user message; `system_prompt` first unless there is a system message) rendered
/// with the generation prompt. Without one: the text as is. Truncated from the left to
/// `max_len` tokens.
pub fn prompt_ids(
    tok: &Tokenizer,
    ex: &Example,
    system_prompt: Option<&str>,
    max_len: Option<usize>,
) -> Result<Vec<u32>> {
    if let Some(t) = &ex.tokens {
        return Ok(t.clone());
    }
    let ids = if tok.has_chat_template() {
        let mut msgs = match &ex.prompt {
            Prompt::Text(t) => vec![ChatMessage::user(t.clone())],
            Prompt::Messages(m) => m.clone(),
        };
        if let Some(s) = system_prompt {
            if !msgs.iter().any(|m| m.role == "system") {
                msgs.insert(0, ChatMessage::system(s));
            }
        }
        tok.encode_chat(&msgs, true)
            .map_err(|e| Error::file(&ex.origin, e))?
    } else {
        match &ex.prompt {
            Prompt::Text(t) => tok.encode(t, true)?,
            Prompt::Messages(_) => {
                let why = "a messages prompt needs a chat template, and this tokenizer has none: \
                           give the prompt as text, or use a model with a chat template";
                return Err(Error::file(&ex.origin, why));
            }
        }
    };
    if ids.is_empty() {
        let why = "the prompt is empty after tokenization: give the row a non-empty prompt";
        return Err(Error::file(&ex.origin, why));
    }
    Ok(match max_len {
        Some(n) if ids.len() > n && n > 0 => ids[ids.len() - n..].to_vec(),
        _ => ids,
    })
}

/// The order prompts are drawn in: epochs over `0..n`, each a permutation seeded by
/// `(seed, epoch)` (or `0..n` without shuffling). The state is `(epoch, pos)`, so a resumed run
/// draws exactly the prompts the uninterrupted one would.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PromptOrder {
    n: usize,
    seed: u64,
    shuffle: bool,
    epoch: usize,
    pos: usize,
    #[serde(skip)]
    perm: Vec<usize>,
}

impl PromptOrder {
    pub fn new(n: usize, seed: u64, shuffle: bool) -> Self {
        Self::restore(n, seed, shuffle, 0, 0)
    }
    pub fn restore(n: usize, seed: u64, shuffle: bool, epoch: usize, pos: usize) -> Self {
        let mut o = Self {
            n,
            seed,
            shuffle,
            epoch,
            pos,
            perm: vec![],
        };
        o.perm = o.permutation(epoch);
        o
    }
    fn permutation(&self, epoch: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..self.n).collect();
        if self.shuffle {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(grpo_models::seeding::mix_seed(
                self.seed,
                epoch as u64,
            ));
            p.shuffle(&mut rng);
        }
        p
    }
    /// The next `k` prompt indices, crossing into the next epoch as needed.
    pub fn next_batch(&mut self, k: usize) -> Vec<usize> {
        if self.perm.len() != self.n {
            self.perm = self.permutation(self.epoch);
        }
        let mut out = Vec::with_capacity(k);
        while out.len() < k && self.n > 0 {
            if self.pos >= self.n {
                self.epoch += 1;
                self.pos = 0;
                self.perm = self.permutation(self.epoch);
            }
            out.push(self.perm[self.pos]);
            self.pos += 1;
        }
        out
    }
    pub fn epoch(&self) -> usize {
        self.epoch
    }
    pub fn position(&self) -> (usize, usize) {
        (self.epoch, self.pos)
    }
}

/// The built-in task: arithmetic word problems from a seed, split into disjoint train and
/// held-out sets.
pub mod arithmetic {
    use std::collections::HashSet;

    use rand::{Rng, SeedableRng};
    use serde_json::{json, Map};

    use super::{Example, Prompt};
    use crate::{Error, Result};

    #[derive(Debug, Clone, PartialEq)]
    pub struct TaskParams {
        pub train_size: usize,
        pub eval_size: usize,
        pub min_operand: i64,
        pub max_operand: i64,
        /// '+', '-', '*'
        pub ops: Vec<char>,
        pub seed: u64,
    }

    /// Every phrasing asks for just the number.
    fn phrase(a: i64, b: i64, op: char, k: usize) -> String {
        let sym = match op {
            '*' => "*",
            '-' => "-",
            _ => "+",
        };
        let plain = [
            format!("What is {a} {sym} {b}? Answer with just the number."),
            format!("Compute {a} {sym} {b}. Reply with only the number."),
            format!("Calculate {a} {sym} {b}. Give only the final number."),
            format!("{a} {sym} {b} = ? Answer with just the number."),
        ];
        let word = match op {
            '+' => [
                format!("Sam has {a} marbles and finds {b} more. How many marbles does Sam have now? Answer with just the number."),
                format!("A shop sold {a} apples in the morning and {b} in the afternoon. How many apples did it sell in total? Answer with just the number."),
                format!("There are {a} birds on a tree and {b} more arrive. How many birds are on the tree? Reply with only the number."),
                format!("Mia read {a} pages on Monday and {b} pages on Tuesday. How many pages did she read? Give only the number."),
            ],
            '-' => [
                format!("Sam has {a} marbles and loses {b}. How many marbles does Sam have left? Answer with just the number."),
                format!("A shop had {a} apples and sold {b}. How many apples are left? Answer with just the number."),
                format!("There are {a} birds on a tree and {b} fly away. How many birds are left? Reply with only the number."),
                format!("A book has {a} pages and Mia has read {b}. How many pages are left? Give only the number."),
            ],
            _ => [
                format!("A box holds {b} pencils. How many pencils are in {a} boxes? Answer with just the number."),
                format!("Each of {a} students brings {b} cookies. How many cookies are there? Answer with just the number."),
                format!("A bus has {a} rows of {b} seats. How many seats are there? Reply with only the number."),
                format!("Mia saves {b} coins a day for {a} days. How many coins does she save? Give only the number."),
            ],
        };
        if k < 4 {
            plain[k].clone()
        } else {
            word[k - 4].clone()
        }
    }

    /// `(train, eval)`; no (a, op, b) appears in both.
    pub fn make_task(p: &TaskParams) -> Result<(Vec<Example>, Vec<Example>)> {
        if p.ops.is_empty() || p.min_operand > p.max_operand {
            return Err(Error::config(
                "task",
                "needs at least one op and min_operand <= max_operand",
            ));
        }
        let span = (p.max_operand - p.min_operand + 1) as u128;
        let distinct = span * span * p.ops.len() as u128;
        let want = (p.train_size + p.eval_size) as u128;
        if want > distinct / 2 {
            return Err(Error::config(
                "task.train_size",
                format!("{want} problems from {distinct} possible: widen the operand range or ask for fewer"),
            ));
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(p.seed);
        let mut seen = HashSet::new();
        let mut all = Vec::with_capacity(want as usize);
        while all.len() < want as usize {
            let op = p.ops[rng.random_range(0..p.ops.len())];
            let (mut a, mut b) = (
                rng.random_range(p.min_operand..=p.max_operand),
                rng.random_range(p.min_operand..=p.max_operand),
            );
            if op == '-' && a < b {
                std::mem::swap(&mut a, &mut b);
            }
            if !seen.insert((a, op, b)) {
                continue;
            }
            let k = rng.random_range(0..8);
            let answer = match op {
                '+' => a + b,
                '-' => a - b,
                _ => a * b,
            };
            let mut meta = Map::new();
            meta.insert("a".into(), json!(a));
            meta.insert("b".into(), json!(b));
            meta.insert("op".into(), json!(op.to_string()));
            all.push((phrase(a, b, op, k), answer, meta));
        }
        let mk =
            |split: &str,
             i: usize,
             (q, ans, meta): (String, i64, Map<String, serde_json::Value>)| Example {
                prompt: Prompt::Text(q),
                answer: Some(ans.to_string()),
                metadata: meta,
                origin: format!("arithmetic:{split}:{i}"),
                tokens: None,
            };
        let eval: Vec<Example> = all
            .drain(..p.eval_size)
            .enumerate()
            .map(|(i, x)| mk("eval", i, x))
            .collect();
        let train: Vec<Example> = all
            .into_iter()
            .enumerate()
            .map(|(i, x)| mk("train", i, x))
            .collect();
        Ok((train, eval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(skip: bool) -> DataFields {
        DataFields {
            prompt_field: "prompt".into(),
            answer_field: "answer".into(),
            skip_bad_rows: skip,
        }
    }

    #[test]
    fn jsonl_rows_messages_and_errors_with_line_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\": \"What is 1+1?\", \"answer\": 2, \"level\": \"easy\"}\n\n\
             {\"prompt\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"answer\": \"x\"}\n\
             {\"question\": \"no prompt\"}\n",
        )
        .unwrap();
        let e = load_examples(&p, &fields(false)).unwrap_err().to_string();
        assert!(
            e.contains("d.jsonl") && e.contains("line 4") && e.contains("prompt_field"),
            "{e}"
        );
        let l = load_examples(&p, &fields(true)).unwrap();
        assert_eq!(l.examples.len(), 2);
        assert_eq!(l.skipped.len(), 1);
        assert_eq!(l.examples[0].answer.as_deref(), Some("2"));
        assert_eq!(l.examples[0].metadata["level"], "easy");
        assert_eq!(
            l.examples[1].prompt,
            Prompt::Messages(vec![ChatMessage::user("Hi")])
        );
        std::fs::write(&p, "{\"prompt\": [{\"role\": \"user\"}]}\n").unwrap();
        let e = load_examples(&p, &fields(false)).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("content"), "{e}");
        std::fs::write(&p, "not json\n").unwrap();
        assert!(load_examples(&p, &fields(false))
            .unwrap_err()
            .to_string()
            .contains("invalid JSON"));
    }

    #[test]
    fn csv_rows_and_unknown_formats() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.csv");
        std::fs::write(&p, "prompt,answer\n\"What is 2+3?\",5\n,7\n").unwrap();
        let e = load_examples(&p, &fields(false)).unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("empty"), "{e}");
        let l = load_examples(&p, &fields(true)).unwrap();
        assert_eq!(l.examples[0].answer.as_deref(), Some("5"));
        let q = dir.path().join("d.xml");
        std::fs::write(&q, "x").unwrap();
        assert!(load_examples(&q, &fields(false))
            .unwrap_err()
            .to_string()
            .contains(".jsonl"));
        // Plain text: one prompt per non-blank line, numbered as in the file.
        let t = dir.path().join("d.txt");
        std::fs::write(&t, "first line\n\n  \nthird line  \n").unwrap();
        let l = load_examples(&t, &fields(false)).unwrap();
        assert_eq!(l.examples.len(), 2);
        assert_eq!(l.examples[1].prompt, Prompt::Text("third line".into()));
        assert!(l.examples[1].origin.ends_with("d.txt:4"));
    }

    #[test]
    fn parquet_rows_strings_numbers_messages_and_nulls() {
        // Files made by scripts/make_parquet_fixtures.py with pyarrow (snappy and gzip).
        let dir =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data");
        let mut f = fields(false);
        f.prompt_field = "question".into();
        let p = dir.join("prompts.parquet");
        let e = load_examples(&p, &f).unwrap_err().to_string();
        assert!(
            e.contains("prompts.parquet") && e.contains("line 3") && e.contains("null"),
            "{e}"
        );
        f.skip_bad_rows = true;
        let l = load_examples(&p, &f).unwrap();
        assert_eq!(l.examples.len(), 3);
        assert_eq!(l.skipped.len(), 1);
        let ex = &l.examples[2];
        assert!(matches!(&ex.prompt, Prompt::Text(t) if t == "What is 40 + 2?"));
        assert_eq!(ex.answer.as_deref(), Some("42"));
        assert_eq!(
            ex.metadata.get("difficulty").and_then(|v| v.as_f64()),
            Some(0.4)
        );

        let mut f = fields(false);
        f.prompt_field = "messages".into();
        let l = load_examples(&dir.join("chat.parquet"), &f).unwrap();
        let Prompt::Messages(m) = &l.examples[0].prompt else {
            panic!("expected messages")
        };
        assert_eq!(
            (m[0].role.as_str(), m[1].content.as_str()),
            ("system", "What is 6 * 7?")
        );
        assert_eq!(l.examples[1].answer.as_deref(), Some("5"));

        let bad = tempfile::tempdir().unwrap();
        let q = bad.path().join("x.parquet");
        std::fs::write(&q, "not parquet").unwrap();
        let e = load_examples(&q, &fields(false)).unwrap_err().to_string();
        assert!(e.contains("x.parquet") && e.contains("Parquet"), "{e}");
    }

    /// prompt_field = "prompt.text": the prompt nested in a record, in JSONL and in a Parquet
    /// struct column (made by scripts/make_parquet_fixtures.py); the rest of the record stays
    /// as metadata; a path that leads nowhere names the field.
    #[test]
    fn a_dotted_prompt_field_reads_nested_records() {
        let mut f = fields(false);
        f.prompt_field = "prompt.text".into();
        let dir =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data");
        let l = load_examples(&dir.join("nested.parquet"), &f).unwrap();
        assert!(matches!(&l.examples[1].prompt, Prompt::Text(t) if t == "Then they"));
        assert_eq!(l.examples[1].metadata["prompt"]["toxicity"], 0.7);
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("rtp.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\": {\"text\": \"Hello\", \"toxicity\": 0.2}}\n{\"prompt\": \"flat\"}\n",
        )
        .unwrap();
        let e = load_examples(&p, &f).unwrap_err().to_string();
        assert!(e.contains("rtp.jsonl") && e.contains("prompt.text"), "{e}");
        f.skip_bad_rows = true;
        let l = load_examples(&p, &f).unwrap();
        assert!(matches!(&l.examples[0].prompt, Prompt::Text(t) if t == "Hello"));
        assert_eq!(l.skipped.len(), 1);
    }

    /// A split in shards: `train-*.parquet` reads every match in name order as one dataset (a
    /// JSONL shard among them too); no match, or two stars, name the pattern.
    #[test]
    fn a_starred_file_name_reads_every_shard_in_order() {
        let fixtures =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data");
        let tmp = tempfile::tempdir().unwrap();
        let shards = tmp.path().join("data");
        std::fs::create_dir(&shards).unwrap();
        for name in [
            "train-00001-of-00002.parquet",
            "train-00000-of-00002.parquet",
        ] {
            std::fs::copy(fixtures.join("prompts.parquet"), shards.join(name)).unwrap();
        }
        std::fs::write(shards.join("test-00000-of-00001.parquet"), "not read").unwrap();
        let mut f = fields(false);
        f.prompt_field = "question".into();
        f.skip_bad_rows = true;
        let l = load_examples(&shards.join("train-*.parquet"), &f).unwrap();
        assert_eq!(l.examples.len(), 6);
        assert_eq!(l.skipped.len(), 2);
        assert!(l.examples[0]
            .origin
            .contains("train-00000-of-00002.parquet"));
        assert!(l.examples[5]
            .origin
            .contains("train-00001-of-00002.parquet"));
        let e = load_examples(&shards.join("valid-*.parquet"), &f)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("valid-*.parquet") && e.contains("no file matches"),
            "{e}"
        );
        let e = load_examples(&shards.join("t*-*.parquet"), &f)
            .unwrap_err()
            .to_string();
        assert!(e.contains("one `*`"), "{e}");
    }

    #[test]
    fn prompt_order_is_deterministic_crosses_epochs_and_restores() {
        let mut a = PromptOrder::new(5, 7, true);
        let first: Vec<usize> = a.next_batch(3);
        let second = a.next_batch(4); // crosses into epoch 1
        assert_eq!(a.epoch(), 1);
        let mut e0: Vec<usize> = first.iter().chain(&second[..2]).copied().collect();
        e0.sort();
        assert_eq!(e0, vec![0, 1, 2, 3, 4]);
        let (ep, pos) = a.position();
        let json = serde_json::to_string(&a).unwrap();
        let mut b: PromptOrder = serde_json::from_str(&json).unwrap();
        let mut c = PromptOrder::restore(5, 7, true, ep, pos);
        let next = a.next_batch(6);
        assert_eq!(b.next_batch(6), next);
        assert_eq!(c.next_batch(6), next);
        let mut d = PromptOrder::new(5, 7, false);
        assert_eq!(d.next_batch(7), vec![0, 1, 2, 3, 4, 0, 1]);
    }

    #[test]
    fn arithmetic_task_is_deterministic_disjoint_and_correct() {
        let p = arithmetic::TaskParams {
            train_size: 300,
            eval_size: 50,
            min_operand: 10,
            max_operand: 99,
            ops: vec!['+', '-', '*'],
            seed: 3,
        };
        let (tr, ev) = arithmetic::make_task(&p).unwrap();
        assert_eq!((tr.len(), ev.len()), (300, 50));
        assert_eq!(arithmetic::make_task(&p).unwrap().0, tr);
        let key = |e: &Example| {
            (
                e.metadata["a"].clone(),
                e.metadata["op"].clone(),
                e.metadata["b"].clone(),
            )
        };
        let train_keys: std::collections::HashSet<_> =
            tr.iter().map(|e| format!("{:?}", key(e))).collect();
        assert!(ev
            .iter()
            .all(|e| !train_keys.contains(&format!("{:?}", key(e)))));
        for e in tr.iter().chain(&ev) {
            let (a, b) = (
                e.metadata["a"].as_i64().unwrap(),
                e.metadata["b"].as_i64().unwrap(),
            );
            let want = match e.metadata["op"].as_str().unwrap() {
                "+" => a + b,
                "-" => a - b,
                _ => a * b,
            };
            assert_eq!(e.answer.as_deref(), Some(want.to_string().as_str()));
            assert!(want >= 0);
            let Prompt::Text(t) = &e.prompt else { panic!() };
            assert!(t.contains("number"), "{t}");
        }
        let too_many = arithmetic::TaskParams {
            train_size: 5000,
            eval_size: 10,
            min_operand: 1,
            max_operand: 9,
            ops: vec!['+'],
            seed: 1,
        };
        assert!(arithmetic::make_task(&too_many).is_err());
    }

    #[test]
    fn prompt_ids_apply_the_chat_template_and_truncate_left() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2");
        let tok = Tokenizer::from_hf_dir(&dir).unwrap();
        let ex = Example {
            prompt: Prompt::Text("What is 2 + 2?".into()),
            answer: None,
            metadata: Map::new(),
            origin: "t".into(),
            tokens: None,
        };
        let ids = prompt_ids(&tok, &ex, Some("Be brief."), None).unwrap();
        let want = tok
            .encode_chat(
                &[
                    ChatMessage::system("Be brief."),
                    ChatMessage::user("What is 2 + 2?"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(ids, want);
        let short = prompt_ids(&tok, &ex, Some("Be brief."), Some(5)).unwrap();
        assert_eq!(short, want[want.len() - 5..]);
    }
}
