//! Chat templates, rendered the way transformers' `apply_chat_template(tokenize=False)` does.
//!
//! transformers compiles a template in a sandboxed Jinja2 environment with `trim_blocks` and
//! `lstrip_blocks` on, the `loopcontrols` extension, its own `tojson` filter (no HTML escaping,
//! Python `json.dumps` formatting), and the globals `raise_exception` and `strftime_now`. It renders
//! with `messages`, `tools` and `documents` (both `None` here), `add_generation_prompt` and the
//! named special tokens (`bos_token`, `eos_token`, ...) as strings. This module sets up minijinja the
//! same way; Python string and dict methods (`.strip()`, `.startswith()`, `.items()`, ...) come
//! from minijinja-contrib's pycompat layer, and lists, dicts and floats print as Python's `str()`
//! would (`['a', 'b']`, `1e+16`).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Output, State};

use super::ChatMessage;
use crate::error::{Error, Result};

const NAME: &str = "chat_template";

/// A compiled chat template.
#[derive(Clone)]
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from, for error messages.
    origin: String,
    /// The template text as given (saved with checkpoints).
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish()
    }
}

impl ChatTemplate {
    /// The template text as given.
    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    /// Compiles `source`; `origin` names where it came from (a file, a GGUF key).
    pub(crate) fn compile(source: &str, origin: impl Into<String>) -> Result<Self> {
        let origin = origin.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, strip_generation_tags(source))
            .map_err(|e| {
                Error::Tokenizer(format!(
                    "chat template from {origin} does not compile: {}",
                    describe(&e)
                ))
            })?;
        Ok(Self {
            env,
            origin,
            source: source.to_string(),
        })
    }

    pub(crate) fn origin(&self) -> &str {
        &self.origin
    }

    /// Renders `messages`. `special_tokens` are the named special tokens (`bos_token`, ...) as
    /// (variable name, token string).
    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        special_tokens: &[(String, String)],
        extra: &[(String, serde_json::Value)],
    ) -> Result<String> {
        let template = self.env.get_template(NAME).map_err(|e| {
            Error::Tokenizer(format!(
                "chat template from {}: {}",
                self.origin,
                describe(&e)
            ))
        })?;
        let mut vars: Vec<(String, Value)> = special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        vars.push(("messages".into(), Value::from_serialize(messages)));
        vars.push(("tools".into(), Value::from(())));
        vars.push(("documents".into(), Value::from(())));
        vars.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        // transformers' `apply_chat_template(**kwargs)`: extra template variables
        // (`enable_thinking` for Qwen3).
        vars.extend(
            extra
                .iter()
                .map(|(k, v)| (k.clone(), Value::from_serialize(v))),
        );
        let ctx: Value = vars.into_iter().collect();
        template.render(ctx).map_err(|e| {
            Error::Tokenizer(format!(
                "chat template from {}: {}",
                self.origin,
                describe(&e)
            ))
        })
    }
}

/// A minijinja error with its causes, on one line.
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let _ = write!(s, ": {cause}");
        source = cause.source();
    }
    s
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask extension) are a
/// pass-through when rendering text; minijinja has no such tag, so they become
/// `{% if true %}` / `{% endif %}`, keeping their whitespace-control markers.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let _ = write!(out, "{{%{lead} {r} {trail}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Prints values as Jinja2 under Python does: lists and dicts as their Python `repr`, floats in
/// Python's notation; everything else as minijinja does (which already prints `True` and `None`).
fn python_formatter(
    out: &mut Output,
    state: &State,
    value: &Value,
) -> std::result::Result<(), minijinja::Error> {
    let text = match value.kind() {
        ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            write_py_repr(&mut s, value)?;
            s
        }
        ValueKind::Number if !value.is_integer() => {
            python_float_repr(f64::try_from(value.clone()).unwrap_or(f64::NAN))
        }
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(&text).map_err(|e| {
        minijinja::Error::new(ErrorKind::WriteFailure, "cannot write the output").with_source(e)
    })
}

/// Python's `repr` of a template value.
fn write_py_repr(out: &mut String, v: &Value) -> std::result::Result<(), minijinja::Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&python_float_repr(
            f64::try_from(v.clone()).unwrap_or(f64::NAN),
        )),
        // A string value always has its text.
        ValueKind::String => write_py_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_repr(out, &item)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_repr(out, &key)?;
                out.push_str(": ");
                write_py_repr(out, &v.get_item(&key)?)?;
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
    Ok(())
}

/// Python's `repr` of a string (approximately: only ASCII controls and C1 controls are escaped).
fn write_py_str(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7F..0xA0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// `raise_exception(message)`: fails the render with the template's message.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("the template raised an exception: {message}"),
    ))
}

/// `strftime_now(format)`: the current time (UTC), formatted like Python's `strftime`.
fn strftime_now(format: String) -> String {
    strftime(&format, chrono::Utc::now().timestamp())
}

/// Python-style `strftime` for a UTC Unix time, by chrono's `strftime` directives (`%-d` and the
/// like included). An unknown directive is kept as written, as glibc does (chrono's lenient
/// parse); a format chrono still cannot write, or a time it cannot represent, gives the format
/// back as written rather than a panic (`to_string` of a failing format panics).
fn strftime(format: &str, unix_secs: i64) -> String {
    let Some(t) = chrono::DateTime::from_timestamp(unix_secs, 0) else {
        return format.to_string();
    };
    let items = chrono::format::StrftimeItems::new_lenient(format);
    let mut out = String::new();
    match write!(out, "{}", t.format_with_items(items)) {
        Ok(()) => out,
        Err(_) => format.to_string(),
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, without Jinja's HTML escaping.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.is_integer() => {
            let n = v.as_i64().unwrap_or(0).max(0) as usize;
            Some(" ".repeat(n))
        }
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !(v.is_none() || v.is_undefined()) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    // Both were checked to be strings just above.
                    a.as_str().unwrap_or_default().to_owned(),
                    b.as_str().unwrap_or_default().to_owned(),
                ),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }
}

fn write_json(
    out: &mut String,
    v: &Value,
    style: &JsonStyle,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float_repr(f));
            }
        }
        ValueKind::String => {
            // A string value always has its text.
            write_json_str(out, v.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Bytes => write_json_str(
            out,
            // A bytes value always has its bytes.
            &String::from_utf8_lossy(v.as_bytes().unwrap_or_default()),
            style.ensure_ascii,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                style.newline(out, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            style.newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in v.try_iter()? {
                let value = v.get_item(&key)?;
                entries.push((json_key(&key)?, value));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, value)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                style.newline(out, depth + 1);
                write_json_str(out, key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, value, style, depth + 1)?;
            }
            style.newline(out, depth);
            out.push('}');
        }
        _ => write_json_str(out, &v.to_string(), style.ensure_ascii),
    }
    Ok(())
}

/// A map key as Python's `json.dumps` writes it.
fn json_key(key: &Value) -> std::result::Result<String, minijinja::Error> {
    Ok(match key.kind() {
        // A string key always has its text.
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None | ValueKind::Undefined => "null".to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => python_float_repr(f64::try_from(key.clone()).unwrap_or(f64::NAN)),
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: keys must be str, int, float, bool or None, not {}",
                    key.kind()
                ),
            ))
        }
    })
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7E) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` as `json.dumps` writes it.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_owned();
    }
    // Shortest round-trip digits, then Python's choice of notation: scientific when the decimal
    // exponent is < -4 or >= 16.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let plain = format!("{f}");
        if plain.contains('.') {
            plain
        } else {
            plain + ".0"
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_kwargs_are_variables_of_the_template() {
        let t = ChatTemplate::compile(
            "{% for m in messages %}{{ m.content }}{% endfor %}\
             {% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}",
            "test",
        )
        .unwrap();
        let msgs = [ChatMessage::user("hi")];
        assert_eq!(t.render(&msgs, true, &[], &[]).unwrap(), "hi");
        let kw = [("enable_thinking".to_string(), serde_json::json!(false))];
        assert_eq!(t.render(&msgs, true, &[], &kw).unwrap(), "hi<nothink>");
    }

    fn render(
        source: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let special = vec![
            ("bos_token".to_owned(), "<s>".to_owned()),
            ("eos_token".to_owned(), "</s>".to_owned()),
        ];
        ChatTemplate::compile(source, "test")?.render(
            messages,
            add_generation_prompt,
            &special,
            &[],
        )
    }

    fn msgs() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "  Be brief.  "),
            ChatMessage::new("user", "Hi <b>&</b> \"é\""),
        ]
    }

    #[test]
    fn blocks_are_trimmed_like_transformers() {
        let src = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}\n";
        assert_eq!(
            render(src, &msgs(), false).unwrap(),
            "[Hi <b>&</b> \"é\"]\n"
        );
    }

    #[test]
    fn python_methods_and_special_tokens() {
        let src = "{{ bos_token }}{{ messages[0]['content'].strip() }}|{{ messages[1].content.startswith('Hi') }}|\
                   {{ messages[0].get('missing', 'dflt') }}{% if add_generation_prompt %}|gen{% endif %}{{ eos_token }}";
        assert_eq!(
            render(src, &msgs(), true).unwrap(),
            "<s>Be brief.|True|dflt|gen</s>"
        );
    }

    #[test]
    fn tools_and_documents_are_none() {
        let src = "{% if tools is none and documents is none %}none{% endif %}";
        assert_eq!(render(src, &msgs(), false).unwrap(), "none");
    }

    #[test]
    fn loop_controls_work() {
        let src = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}";
        assert_eq!(render(src, &msgs(), false).unwrap(), "system");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let src = "{{ messages[1] | tojson }}";
        assert_eq!(
            render(src, &msgs(), false).unwrap(),
            r#"{"role": "user", "content": "Hi <b>&</b> \"é\""}"#
        );
        let src = "{{ {'b': [1, 2.5, none, true], 'a': {}} | tojson(indent=2) }}";
        assert_eq!(
            render(src, &msgs(), false).unwrap(),
            "{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": {}\n}"
        );
        let src = "{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=true, ensure_ascii=true, separators=[',', ':']) }}";
        assert_eq!(
            render(src, &msgs(), false).unwrap(),
            r#"{"a":"\u00e9","b":1}"#
        );
    }

    #[test]
    fn values_print_like_python() {
        let src =
            "{{ ['a', \"it's\", 1, 2.0, none, true] }} {{ messages[0] }} {{ 0.5 * 3 }} {{ 1e20 }}";
        assert_eq!(
            render(src, &msgs(), false).unwrap(),
            r#"['a', "it's", 1, 2.0, None, True] {'role': 'system', 'content': '  Be brief.  '} 1.5 1e+20"#
        );
    }

    #[test]
    fn float_repr_is_pythons() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(1e15), "1000000000000000.0");
        assert_eq!(python_float_repr(1.5e-5), "1.5e-05");
        assert_eq!(python_float_repr(0.0001), "0.0001");
        assert_eq!(python_float_repr(-2.5e100), "-2.5e+100");
    }

    #[test]
    fn raise_exception_fails_with_the_message() {
        let src = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}";
        let err = render(src, &msgs(), false).unwrap_err().to_string();
        assert!(err.contains("System role not supported"), "{err}");
        assert!(err.contains("test"), "{err}");
    }

    #[test]
    fn bad_template_names_its_origin() {
        let err = ChatTemplate::compile("{% for %}", "somewhere/tokenizer_config.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("somewhere/tokenizer_config.json"), "{err}");
    }

    #[test]
    fn generation_tags_pass_through() {
        let src = "{% for m in messages %}{%- generation -%}\n{{ m.role }}\n{%- endgeneration %}{% endfor %}";
        assert_eq!(render(src, &msgs(), false).unwrap(), "systemuser");
        assert_eq!(
            strip_generation_tags("a{%- generation +%}b{% endgeneration %}"),
            "a{%- if true +%}b{% endif %}"
        );
        assert_eq!(
            strip_generation_tags("{{ x }}{% if y %}"),
            "{{ x }}{% if y %}"
        );
    }

    #[test]
    fn strftime_formats() {
        // 2024-11-22 07:29:05 UTC, a Friday, day 327 of a leap year.
        let t = 1_732_260_545;
        assert_eq!(strftime("%d %b %Y", t), "22 Nov 2024");
        assert_eq!(
            strftime("%A %B %-d, %H:%M:%S %j %%", t),
            "Friday November 22, 07:29:05 327 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
        assert_eq!(
            strftime("%e|%-m|%-H|%I %p|%F %T %Z %z", t),
            "22|11|7|07 AM|2024-11-22 07:29:05 UTC +0000"
        );
    }

    #[test]
    fn strftime_keeps_unknown_directives() {
        let t = 1_732_260_545;
        // No panic: an unknown directive (and a lone `%` at the end) is kept as written, the
        // rest formatted.
        assert_eq!(strftime("%d %K %Y", t), "22 %K 2024");
        assert_eq!(strftime("%Y %% %K%m%", t), "2024 % %K11%");
        assert_eq!(strftime("%", t), "%");
        assert_eq!(strftime("no directives", t), "no directives");
        assert_eq!(strftime("%Y", i64::MAX), "%Y");
        assert!(!strftime_now("%Y-%m-%d".into()).contains('%'));
    }
}
