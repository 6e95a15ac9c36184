//! HF chat templates rendered with minijinja, byte for byte like transformers.
//!
//! transformers renders with jinja2's sandbox, `trim_blocks=True`,
//! `lstrip_blocks=True`, the `loopcontrols` extension, its own `tojson`
//! (`json.dumps` with `ensure_ascii=False`, no HTML escaping), and the globals
//! `raise_exception` and `strftime_now`; the special-token strings and any extra
//! keyword arguments become template variables. We mirror each of those; Python
//! string/dict methods (`.strip()`, `.split()`, `.items()`, ...) come from
//! minijinja-contrib's pycompat callback.
//!
//! Where minijinja and jinja2 (or transformers' preprocessing) differ, we
//! bridge the gap here:
//! - transformers' `{% generation %}...{% endgeneration %}` tag (it marks the
//!   assistant tokens for `return_assistant_tokens_mask` and renders its body
//!   unchanged) is rewritten, token-exactly, into `{% if true %}...{% endif %}`;
//! - JSON null and the template's `none` literals are one [`PyNone`], which
//!   behaves like Python's `None` where minijinja's own none does not: it
//!   cannot be iterated (select/map-style filters still give nothing for it);
//! - messages lose their None-valued keys and get their reasoning aliased,
//!   as transformers 5 does before rendering (`message_value`);
//! - jinja2's `indent`, `trim`, `.strip()`/`.split()` whitespace, and
//!   `tojson` refusing Undefined.
//!
//! Known differences left alone: markupsafe escapes plain strings added to a
//! `|safe` string (`"a"|safe + x|tojson` gives `&#34;` in jinja2; minijinja
//! concatenates without escaping); minijinja's `map` is a list where jinja2's
//! generator makes `tojson` raise; `x in none` is false instead of raising.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use minijinja::machinery::{tokenize, Token};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Object, ObjectRepr, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{filters, Environment, Error, ErrorKind, State};
use serde_json::{Map, Value as Json};

use crate::error::CoreError;

const NAME: &str = "chat";

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's raw text and string constants, joined by NUL (what
    /// transformers searches for the added tokens a template writes itself).
    literals: String,
    /// The one `PyNone` of this template: JSON nulls and `none` literals.
    none: Value,
}

/// What a render needs besides the template.
#[derive(Debug, Default, Clone)]
pub struct RenderInput<'a> {
    pub messages: &'a [Json],
    pub tools: Option<&'a Json>,
    pub add_generation_prompt: bool,
    /// Special-token strings (`bos_token`, `eos_token`, ...) and extra kwargs.
    pub vars: Map<String, Json>,
}

fn template_error(e: &Error) -> CoreError {
    // raise_exception's message is the template author's: pass it on verbatim.
    if e.kind() == ErrorKind::InvalidOperation {
        if let Some(d) = e.detail() {
            if let Some(msg) = d.strip_prefix("raise_exception: ") {
                return CoreError::Template(msg.to_owned());
            }
        }
    }
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    CoreError::Template(msg)
}

/// Python's `None` as templates see a JSON null (`tools=None`, a tool-call
/// message's `content: null`): falsy, prints `None`, passes `is none`, dumps
/// as `null`, and, unlike minijinja's none (which iterates as empty), raises
/// when iterated, so `{% for t in tools %}` fails where transformers fails
/// instead of rendering a prompt the engine never produced.
#[derive(Debug)]
struct PyNone;

impl Object for PyNone {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Plain
    }

    fn is_true(self: &Arc<Self>) -> bool {
        false
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("None")
    }
}

fn is_py_none(v: &Value) -> bool {
    v.is_none() || v.downcast_object_ref::<PyNone>().is_some()
}

/// `PyNone` as minijinja's own none, for filters whose none handling is
/// already jinja2's.
fn none_to_native(v: Value) -> Value {
    if is_py_none(&v) {
        Value::from(())
    } else {
        v
    }
}

/// A JSON value as the template sees it (nulls become the shared `none`).
fn to_value(j: &Json, none: &Value) -> Value {
    match j {
        Json::Null => none.clone(),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => items.iter().map(|x| to_value(x, none)).collect(),
        Json::Object(m) => Value::from_pairs(
            m.iter()
                .map(|(k, v)| (Value::from(k.as_str()), to_value(v, none)))
                .collect::<Vec<_>>(),
        ),
    }
}

/// The fields transformers reads reasoning from, in the order it prefers them.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A message as transformers hands it to the template (5.x: the version the
/// parity tests run against). `apply_chat_template` first drops the keys whose
/// value is None (the OpenAI SDK sends `content: None` beside tool calls), then
/// copies the reasoning into both `thinking` and `reasoning_content`, so one
/// template reads reasoning whatever the client called it. Key order is kept
/// as Python's `{"thinking": r, **message, "reasoning_content": r}` builds it:
/// it shows when a template prints or iterates a message.
fn message_value(m: &Json, none: &Value) -> Value {
    let Json::Object(fields) = m else {
        return to_value(m, none); // `render` has refused non-objects already
    };
    let kept = fields
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.as_str(), v));
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|k| fields.get(*k).filter(|v| !v.is_null()));
    let pairs: Vec<(&str, &Json)> = match reasoning {
        None => kept.collect(),
        Some(r) => {
            // An existing key keeps its place and takes the later value.
            let mut out = vec![("thinking", r)];
            for (k, v) in kept {
                if k == "thinking" {
                    out[0].1 = v;
                } else {
                    out.push((k, v));
                }
            }
            match out.iter_mut().find(|(k, _)| *k == "reasoning_content") {
                Some(slot) => slot.1 = r,
                None => out.push(("reasoning_content", r)),
            }
            out
        }
    };
    Value::from_pairs(
        pairs
            .into_iter()
            .map(|(k, v)| (Value::from(k), to_value(v, none)))
            .collect::<Vec<_>>(),
    )
}

/// The global the template's `none` literals are renamed to (see `rewrite`).
const NONE_GLOBAL: &str = "__lightning_none";

/// One pass of minijinja's own lexer over the source gives the template's raw
/// text and string literals (NUL-joined: what transformers searches for the
/// added tokens a template writes itself) and two token-exact rewrites, so
/// that text, strings, comments and raw blocks that merely spell them are
/// untouched:
/// - transformers' `{% generation %}` / `{% endgeneration %}` become
///   `{% if true %}` / `{% endif %}`, keeping the tag's whitespace control;
/// - the literal `none` / `None` becomes the one shared [`PyNone`], so that
///   `tools == none`, `x in [none]` and `{% set x = none %}` see the same
///   value JSON nulls are (minijinja's own none never equals an object).
///   Not where the word is a test (`is none`, `is not none`) or an attribute
///   (`x.none`).
fn rewrite(source: &str, syntax: SyntaxConfig) -> Result<(String, String), CoreError> {
    let mut toks = Vec::new();
    for tok in tokenize(source, false, syntax) {
        toks.push(tok.map_err(|e| template_error(&e))?);
    }
    let mut literals: Vec<&str> = Vec::new();
    let mut edits: Vec<(usize, usize, &str)> = Vec::new();
    for (i, (tok, span)) in toks.iter().enumerate() {
        let prev = |k: usize| i.checked_sub(k).map(|j| &toks[j].0);
        let range = (span.start_offset as usize, span.end_offset as usize);
        match tok {
            Token::Ident(name @ ("generation" | "endgeneration"))
                if matches!(prev(1), Some(Token::BlockStart)) =>
            {
                let with = if *name == "generation" {
                    "if true"
                } else {
                    "endif"
                };
                edits.push((range.0, range.1, with));
            }
            Token::TemplateData(t) | Token::Str(t) => literals.push(t),
            Token::String(t) => literals.push(t),
            Token::Ident("none" | "None") => {
                let is_test = matches!(prev(1), Some(Token::Ident("is")))
                    || (matches!(prev(1), Some(Token::Ident("not")))
                        && matches!(prev(2), Some(Token::Ident("is"))));
                let attribute = matches!(prev(1), Some(Token::Dot));
                if !(is_test || attribute) {
                    edits.push((range.0, range.1, NONE_GLOBAL));
                }
            }
            _ => {}
        }
    }
    let literals = literals.join("\0");
    let mut out = source.to_owned();
    for &(a, b, with) in edits.iter().rev() {
        out.replace_range(a..b, with);
    }
    Ok((out, literals))
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<Self, CoreError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&e))?;
        let (source, literals) = rewrite(source, syntax.clone())?;
        let none = Value::from_object(PyNone);
        env.add_global(NONE_GLOBAL, none.clone());
        env.set_syntax(syntax);
        let method_none = none.clone();
        env.set_unknown_method_callback(move |state, value, method, args| {
            // Python's idea of whitespace for the argument-less forms; the
            // rest of the str/dict methods come from pycompat.
            if let (Some(s), true) = (value.as_str(), args.is_empty()) {
                match method {
                    "strip" => return Ok(Value::from(s.trim_matches(py_space))),
                    "lstrip" => return Ok(Value::from(s.trim_start_matches(py_space))),
                    "rstrip" => return Ok(Value::from(s.trim_end_matches(py_space))),
                    "split" => {
                        let parts = s.split(py_space).filter(|p| !p.is_empty());
                        return Ok(Value::from(parts.map(Value::from).collect::<Vec<_>>()));
                    }
                    _ => {}
                }
            }
            // `.get('missing')` and friends give Python's None, the shared one.
            minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
                .map(|v| if v.is_none() { method_none.clone() } else { v })
        });
        // jinja2's trim is `str.strip(chars)`.
        env.add_filter("trim", |s: String, chars: Option<String>| -> String {
            match chars {
                None => s.trim_matches(py_space).to_owned(),
                Some(cs) => s.trim_matches(|c| cs.contains(c)).to_owned(),
            }
        });
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("raise_exception: {msg}"),
            ))
        });
        env.add_function("strftime_now", |fmt: String| -> Result<Value, Error> {
            Ok(Value::from(strftime_now(&fmt)))
        });
        env.add_filter("tojson", tojson);
        env.add_filter("indent", indent);
        env.add_test("none", |v: &Value| is_py_none(v));
        env.add_test("sameas", |a: &Value, b: &Value| {
            (is_py_none(a) && is_py_none(b)) || minijinja::tests::is_sameas(a, b)
        });
        // jinja2's select/reject/map filters return nothing for a falsy input
        // (`if value:` guards their loops), and int/float give their default
        // for None: hand them minijinja's none, which they treat that way.
        // One wrapper per filter: each keeps its builtin's arguments.
        macro_rules! none_as_native {
            ($name:literal, $builtin:path, $($arg:ident: $ty:ty),*) => {
                env.add_filter($name, |st: &mut State, v: Value, $($arg: $ty),*| {
                    $builtin(st, none_to_native(v), $($arg),*)
                });
            };
        }
        type Test<'a> = Option<Cow<'a, str>>;
        type Args = Rest<ValueOrKwargs>;
        none_as_native!("select", filters::select, t: Test<'_>, a: Args);
        none_as_native!("reject", filters::reject, t: Test<'_>, a: Args);
        none_as_native!("selectattr", filters::selectattr, k: Cow<'_, str>, t: Test<'_>, a: Args);
        none_as_native!("rejectattr", filters::rejectattr, k: Cow<'_, str>, t: Test<'_>, a: Args);
        none_as_native!("map", filters::map, a: Args);
        env.add_filter(
            "int",
            |st: &State, v: &Value, d: Option<Value>, base: Option<u32>, kw: Kwargs| {
                filters::int(st, &none_to_native(v.clone()), d, base, kw)
            },
        );
        env.add_filter(
            "float",
            |st: &State, v: &Value, d: Option<Value>, kw: Kwargs| {
                filters::float(st, &none_to_native(v.clone()), d, kw)
            },
        );
        // Python: None and numbers are not iterable (minijinja iterates none as empty).
        env.add_test("iterable", |v: &Value| {
            matches!(
                v.kind(),
                ValueKind::Seq | ValueKind::Map | ValueKind::String | ValueKind::Iterable
            )
        });
        env.add_template_owned(NAME, source)
            .map_err(|e| template_error(&e))?;
        Ok(Self {
            env,
            literals,
            none,
        })
    }

    /// Whether `text` occurs in the template's own text or string literals.
    pub fn writes_literally(&self, text: &str) -> bool {
        self.literals.contains(text)
    }

    /// Render like `apply_chat_template(..., tokenize=False)`.
    pub fn render(&self, input: &RenderInput<'_>) -> Result<String, CoreError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| template_error(&e))?;
        if let Some(i) = input.messages.iter().position(|m| !m.is_object()) {
            return Err(CoreError::InvalidInput(format!(
                "message {i} is not an object: chat messages are dicts with a role and content"
            )));
        }
        let none = &self.none;
        let mut ctx: Vec<(Value, Value)> = input
            .vars
            .iter()
            .map(|(k, v)| (Value::from(k.as_str()), to_value(v, none)))
            .collect();
        let messages: Value = input
            .messages
            .iter()
            .map(|m| message_value(m, none))
            .collect();
        let tools = input
            .tools
            .map_or_else(|| none.clone(), |t| to_value(t, none));
        ctx.extend([
            (Value::from("messages"), messages),
            (Value::from("tools"), tools),
            (Value::from("documents"), none.clone()),
            (
                Value::from("add_generation_prompt"),
                Value::from(input.add_generation_prompt),
            ),
        ]);
        tmpl.render(Value::from_pairs(ctx))
            .map_err(|e| template_error(&e))
    }
}

/// Python's `str.isspace`: Unicode White_Space plus the separators U+001C..U+001F.
pub(crate) fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.splitlines()` (without keepends): every line boundary Python
/// knows, `\r\n` as one.
fn py_splitlines(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut it = s.char_indices().peekable();
    while let Some((i, c)) = it.next() {
        let boundary = matches!(
            c,
            '\n' | '\r'
                | '\u{0b}'
                | '\u{0c}'
                | '\u{1c}'
                | '\u{1d}'
                | '\u{1e}'
                | '\u{85}'
                | '\u{2028}'
                | '\u{2029}'
        );
        if !boundary {
            continue;
        }
        out.push(&s[start..i]);
        start = i + c.len_utf8();
        if c == '\r' {
            if let Some(&(j, '\n')) = it.peek() {
                it.next();
                start = j + 1;
            }
        }
    }
    if start < s.len() {
        out.push(&s[start..]);
    }
    out
}

/// jinja2's `indent(s, width=4, first=False, blank=False)`, whose handling of
/// a trailing newline (kept) minijinja's differs from; `width` may be a string.
fn indent(
    s: &Value,
    width: Option<Value>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let text = s.as_str().ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("indent: expected a string, got {}", s.kind()),
        )
    })?;
    let width = match width {
        Some(w) => Some(w),
        None => kwargs.get::<Option<Value>>("width")?,
    };
    let first = first
        .or(kwargs.get::<Option<bool>>("first")?)
        .unwrap_or(false);
    let blank = blank
        .or(kwargs.get::<Option<bool>>("blank")?)
        .unwrap_or(false);
    kwargs.assert_all_used()?;
    let pad = match width {
        None => "    ".to_owned(),
        Some(w) => match w.as_str() {
            Some(p) => p.to_owned(),
            None => " ".repeat(usize::try_from(i64::try_from(w)?.max(0)).unwrap_or(0)),
        },
    };
    // jinja2 appends a newline before splitting, so a trailing one survives.
    let with_nl = format!("{text}\n");
    let lines = py_splitlines(&with_nl);
    let mut out = String::with_capacity(text.len() + pad.len() * lines.len());
    if blank {
        for (i, line) in lines.iter().enumerate() {
            if i > 0 {
                out.push('\n');
                out.push_str(&pad);
            }
            out.push_str(line);
        }
    } else if let Some((head, rest)) = lines.split_first() {
        out.push_str(head);
        if !rest.is_empty() {
            for line in rest {
                out.push('\n');
                if !line.is_empty() {
                    out.push_str(&pad);
                }
                out.push_str(line);
            }
        }
    }
    if first {
        out.insert_str(0, &pad);
    }
    let safe = s.is_safe();
    Ok(if safe {
        Value::from_safe_string(out)
    } else {
        Value::from(out)
    })
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside
/// 1e-4 <= |x| < 1e16, always a `.0` or exponent so it reads back as a float.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if x == 0.0 {
        return if x.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sci = format!("{x:e}"); // e.g. "1.5e-5", shortest round-trip digits
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", exp.abs());
    }
    let s = format!("{x}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

fn json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn dump(v: &Value, st: &JsonStyle, depth: usize, out: &mut String) -> Result<(), Error> {
    let newline = |out: &mut String, d: usize| {
        if let Some(ind) = &st.indent {
            out.push('\n');
            for _ in 0..d {
                out.push_str(ind);
            }
        }
    };
    if is_py_none(v) {
        out.push_str("null");
        return Ok(());
    }
    match v.kind() {
        // json.dumps refuses jinja2's Undefined (a missing key or variable).
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: Object of type Undefined is not JSON serializable",
            ))
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Ok(i) = i128::try_from(v.clone()) {
                if v.as_i64().is_some() || !format!("{v}").contains('.') {
                    out.push_str(&i.to_string());
                    return Ok(());
                }
            }
            let f = f64::try_from(v.clone())
                .map_err(|_| Error::new(ErrorKind::InvalidOperation, "tojson: bad number"))?;
            out.push_str(&py_float(f));
        }
        ValueKind::String => json_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, it) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item_sep);
                }
                newline(out, depth + 1);
                dump(it, st, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if st.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item_sep);
                }
                newline(out, depth + 1);
                match k.as_str() {
                    Some(s) => json_str(s, out),
                    None => json_str(&k.to_string(), out),
                }
                out.push_str(&st.key_sep);
                dump(&v.get_item(k)?, st, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: object of kind {:?} is not JSON serializable",
                    v.kind()
                ),
            ))
        }
    }
    Ok(())
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(v: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent.or(kwargs.get::<Option<Value>>("indent")?) {
        None => None,
        Some(i) if i.is_none() => None,
        Some(i) => match i.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(i64::try_from(i).unwrap_or(0).max(0) as usize)),
        },
    };
    let seps: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match seps {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let _ = kwargs.get::<Option<bool>>("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dump(
        v,
        &JsonStyle {
            indent,
            item_sep,
            key_sep,
            sort_keys,
        },
        0,
        &mut out,
    )?;
    Ok(Value::from_safe_string(out))
}

/// `strftime_now(fmt)`: the current UTC time formatted like Python's strftime
/// (the common directives; transformers uses local time, which is UTC here).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(secs, fmt)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Format Unix seconds (UTC) with a subset of strftime directives.
pub fn strftime(secs: i64, fmt: &str) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let (hh, mm, ss) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_date() {
        // 2024-07-26 12:34:56 UTC was a Friday.
        assert_eq!(
            strftime(1_721_997_296, "%d %b %Y %H:%M:%S %A"),
            "26 Jul 2024 12:34:56 Friday"
        );
    }

    #[test]
    fn python_float_repr() {
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(0.1), "0.1");
        assert_eq!(py_float(1e-5), "1e-05");
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(123.25), "123.25");
    }

    #[test]
    fn tojson_matches_json_dumps() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}").unwrap();
        let x: Json = serde_json::from_str(r#"{"b": [1, 2.5, "é\n"], "a": null}"#).unwrap();
        let mut vars = Map::new();
        vars.insert("x".into(), x);
        let out = t
            .render(&RenderInput {
                vars,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, \"é\\n\"], \"a\": null}|{\n  \"b\": [\n    1,\n    2.5,\n    \"é\\n\"\n  ],\n  \"a\": null\n}"
        );
    }

    fn render(src: &str, vars: Json) -> String {
        let t = ChatTemplate::new(src).unwrap();
        let Json::Object(vars) = vars else {
            panic!("vars must be an object")
        };
        t.render(&RenderInput {
            vars,
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn python_splitlines() {
        assert_eq!(py_splitlines("a\r\nb\rc\n"), ["a", "b", "c"]);
        assert_eq!(py_splitlines("x\u{2028}y\u{85}"), ["x", "y"]);
        assert_eq!(py_splitlines("\n"), [""]);
        assert!(py_splitlines("").is_empty());
    }

    #[test]
    fn rewrite_touches_only_the_tags_and_none_values() {
        let src = "{% raw %}{% generation %} == none{% endraw %}{{ x.none }}{{ y is none }}\
                   {{ y is not None }}{{ y == none }}{{ 'none' }}";
        let (out, literals) = rewrite(src, SyntaxConfig::default()).unwrap();
        assert!(literals.contains("{% generation %} == none") && literals.contains("none"));
        assert_eq!(
            out,
            "{% raw %}{% generation %} == none{% endraw %}{{ x.none }}{{ y is none }}\
             {{ y is not None }}{{ y == __lightning_none }}{{ 'none' }}"
        );
        let rendered = render(
            "{%- generation -%} a {% endgeneration %}|{{ y == none }}{{ y != None }}",
            serde_json::json!({"y": null}),
        );
        assert_eq!(rendered, "a |TrueFalse");
    }

    #[test]
    fn indent_keeps_a_trailing_newline_like_jinja2() {
        let out = render(
            "{{ '{\\n' | indent(4, first=true) }}|{{ 'a\\nb' | indent(2) }}",
            serde_json::json!({}),
        );
        assert_eq!(out, "    {\n|a\n  b");
    }

    #[test]
    fn raise_exception_message_passes_through() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}").unwrap();
        let err = t.render(&RenderInput::default()).unwrap_err();
        assert_eq!(err.to_string(), "roles must alternate");
    }
}
