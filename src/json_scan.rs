//! A single-pass scanner for the top-level fields of a JSON object.
//!
//! The filter needs two or three top-level fields (`routed_dp_rank`, `routing_key`, ...) out of a
//! chat-completions body that may be megabytes of prompt. Building a DOM of the whole prompt would
//! allocate for every message; this scanner walks the bytes once, checks the structure (so malformed
//! bodies are recognised and passed through untouched) and hands back only the wanted values.
//!
//! Properties that matter on the request path:
//! - no recursion: nesting depth is tracked with a bit stack, so 100,000 nested brackets cost memory
//!   proportional to the depth / 8 and never overflow the wasm stack;
//! - strings are skipped eight bytes at a time (SWAR), which is most of a prompt;
//! - it never panics on any input: every index is checked.
//!
//! # Which bodies it accepts: the engines' parser, not just RFC 8259
//!
//! SGLang and vLLM read a request body with FastAPI, which hands the bytes to Starlette's
//! `Request.json()`, i.e. Python's `json.loads(bytes)`, and validates the dict with pydantic. A
//! body that parser accepts but this scanner refused would be counted `body_malformed` and its
//! routing key ignored while the engine serves it, so the scanner accepts everything `json.loads`
//! does on a UTF-8 body:
//! - one UTF-8 byte order mark at the very start (`json.loads` of bytes decodes them as
//!   `utf-8-sig`); a second one, or one after whitespace, is refused as Python refuses it;
//! - `NaN`, `Infinity` and `-Infinity` as numbers (reported as [`Value::Number`] with that text);
//!   `-NaN`, `+Infinity`, `nan` stay errors, as in Python;
//! - lone surrogates in `\u` escapes (see `Scanner::string` for the bytes they become);
//! - duplicate member names: every occurrence is reported, in document order, so a caller can
//!   keep the last one as Python's `dict` does.
//!
//! Leniency beyond Python, by design, where it cannot route a request wrongly (the engine refuses
//! such a body whole, so the rank the filter picked never serves it): bytes inside strings are
//! not UTF-8 validated; raw control characters inside strings, integers of more than 4,300
//! digits and nesting deeper than Python's recursion limit are accepted. Not accepted: UTF-16 and
//! UTF-32 bodies (which `json.loads` detects and decodes): RFC 8259 requires UTF-8 between
//! systems, no client library sends them, and reading them would need a body-sized copy.

use std::borrow::Cow;

/// A top-level value handed back for a wanted field.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    /// A string, unescaped. Borrowed when it had no escapes.
    Str(Cow<'a, [u8]>),
    /// A number, as its raw JSON text (grammar-checked).
    Number(&'a [u8]),
    Bool(bool),
    Null,
    Object,
    Array,
}

impl Value<'_> {
    /// The JSON type name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Str(_) => "string",
            Value::Number(_) => "number",
            Value::Bool(_) => "boolean",
            Value::Null => "null",
            Value::Object => "object",
            Value::Array => "array",
        }
    }
}

/// Why a body is not a JSON object the scanner accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanError {
    /// The body is not a JSON object at the top level.
    NotAnObject,
    /// Syntax error at this byte offset (includes truncation).
    Syntax(usize),
}

/// Scans `body`, calling `found(index, value)` for every top-level member whose name equals
/// `wanted[index]`, in document order (a duplicated member is reported each time).
///
/// The whole body is checked before returning `Ok`, so callers should only act on the values once
/// `Ok(())` came back: a truncated body reports its early fields, then fails.
pub fn scan_top_level<'a>(
    body: &'a [u8],
    wanted: &[&str],
    mut found: impl FnMut(usize, Value<'a>),
) -> Result<(), ScanError> {
    let (mut s, _, empty) = Scanner::open_object(body)?;
    if empty {
        return s.expect_end();
    }
    loop {
        s.skip_ws();
        let name = s.string()?;
        s.skip_ws();
        s.expect(b':')?;
        s.skip_ws();
        let which = wanted.iter().position(|w| w.as_bytes() == &*name);
        match which {
            Some(idx) => {
                let v = s.value()?;
                found(idx, v);
            }
            None => s.skip_value()?,
        }
        s.skip_ws();
        match s.next_byte()? {
            b',' => continue,
            b'}' => return s.expect_end(),
            _ => return Err(ScanError::Syntax(s.i - 1)),
        }
    }
}

/// The UTF-8 byte order mark, which Python's `json.loads(bytes)` skips at the start of a body.
pub const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// How many bytes of a byte order mark `body` starts with: 3 or 0.
fn bom_len(body: &[u8]) -> usize {
    if body.starts_with(UTF8_BOM) {
        UTF8_BOM.len()
    } else {
        0
    }
}

/// The cursor over a body. Crate-visible so other single-pass walkers (the prompt walker in
/// `prompt`) reuse the same grammar checks instead of growing a second JSON reader.
pub(crate) struct Scanner<'a> {
    pub(crate) b: &'a [u8],
    pub(crate) i: usize,
}

impl<'a> Scanner<'a> {
    /// How every body walker starts: past one UTF-8 byte-order mark (Python's `json.loads(bytes)`
    /// skips one, and only at the very start), whitespace, the top-level object's `{` and the
    /// whitespace after it. Returns the scanner there, the `{`'s position, and whether the object
    /// is empty (its `}` consumed then).
    pub(crate) fn open_object(body: &'a [u8]) -> Result<(Scanner<'a>, usize, bool), ScanError> {
        let mut s = Scanner {
            b: body,
            i: bom_len(body),
        };
        s.skip_ws();
        if s.peek() != Some(b'{') {
            return Err(ScanError::NotAnObject);
        }
        let open = s.i;
        s.i += 1;
        s.skip_ws();
        let empty = s.peek() == Some(b'}');
        if empty {
            s.i += 1;
        }
        Ok((s, open, empty))
    }

    pub(crate) fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn err(&self) -> ScanError {
        ScanError::Syntax(self.i)
    }

    pub(crate) fn next_byte(&mut self) -> Result<u8, ScanError> {
        let c = self.peek().ok_or(self.err())?;
        self.i += 1;
        Ok(c)
    }

    pub(crate) fn expect(&mut self, c: u8) -> Result<(), ScanError> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(self.err())
        }
    }

    pub(crate) fn expect_end(&mut self) -> Result<(), ScanError> {
        self.skip_ws();
        if self.i == self.b.len() {
            Ok(())
        } else {
            Err(self.err())
        }
    }

    pub(crate) fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.i += 1;
        }
    }

    /// Parses one value of a wanted member.
    pub(crate) fn value(&mut self) -> Result<Value<'a>, ScanError> {
        match self.peek() {
            Some(b'"') => Ok(Value::Str(self.string()?)),
            Some(b'{') => self.skip_value().map(|_| Value::Object),
            Some(b'[') => self.skip_value().map(|_| Value::Array),
            Some(b't') => self.literal(b"true").map(|_| Value::Bool(true)),
            Some(b'f') => self.literal(b"false").map(|_| Value::Bool(false)),
            Some(b'n') => self.literal(b"null").map(|_| Value::Null),
            Some(b'-' | b'0'..=b'9' | b'N' | b'I') => self.number().map(Value::Number),
            _ => Err(self.err()),
        }
    }

    fn literal(&mut self, word: &[u8]) -> Result<(), ScanError> {
        if self.b.get(self.i..self.i + word.len()) == Some(word) {
            self.i += word.len();
            Ok(())
        } else {
            Err(self.err())
        }
    }

    /// Checks the number grammar `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`, plus Python's
    /// `NaN`, `Infinity` and `-Infinity` (never `-NaN`), which `json.loads` reads as floats.
    pub(crate) fn number(&mut self) -> Result<&'a [u8], ScanError> {
        let start = self.i;
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek() {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => self.digits(),
            Some(b'I') => return self.literal(b"Infinity").map(|_| &self.b[start..self.i]),
            Some(b'N') if self.i == start => {
                return self.literal(b"NaN").map(|_| &self.b[start..self.i]);
            }
            _ => return Err(self.err()),
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            self.one_or_more_digits()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            self.one_or_more_digits()?;
        }
        Ok(&self.b[start..self.i])
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
    }

    fn one_or_more_digits(&mut self) -> Result<(), ScanError> {
        let start = self.i;
        self.digits();
        if self.i == start {
            Err(self.err())
        } else {
            Ok(())
        }
    }

    /// Parses a string at the cursor (which must be on `"`), unescaping only when needed.
    ///
    /// The bytes handed back are what Python's `s.encode("utf-8", "surrogatepass")` gives for
    /// the string `json.loads` reads (on a body that is valid UTF-8), so equal strings to the
    /// engine are equal bytes here, and a routing key hashes the same however it was escaped.
    /// A lone surrogate escape (`\ud800`, or a high one not followed by a low one) becomes the
    /// three bytes of its code point in generalised UTF-8 (`ED A0 80`), as Python's codec writes
    /// it: distinct lone surrogates stay distinct keys, and a raw `ED A0 80` in the body (which
    /// Python decodes to the same lone surrogate) hashes the same as its escape.
    pub(crate) fn string(&mut self) -> Result<Cow<'a, [u8]>, ScanError> {
        self.expect(b'"')?;
        let start = self.i;
        self.i = find_quote_or_backslash(self.b, self.i);
        match self.peek() {
            Some(b'"') => {
                let s = &self.b[start..self.i];
                self.i += 1;
                Ok(Cow::Borrowed(s))
            }
            Some(_) => {
                let mut out = self.b[start..self.i].to_vec();
                self.unescape_rest(&mut out)?;
                Ok(Cow::Owned(out))
            }
            None => Err(self.err()),
        }
    }

    /// Continues a string from a backslash, appending the unescaped bytes to `out`.
    fn unescape_rest(&mut self, out: &mut Vec<u8>) -> Result<(), ScanError> {
        loop {
            match self.next_byte()? {
                b'"' => return Ok(()),
                b'\\' => {
                    let esc = self.next_byte()?;
                    match esc {
                        b'"' | b'\\' | b'/' => out.push(esc),
                        b'b' => out.push(0x08),
                        b'f' => out.push(0x0c),
                        b'n' => out.push(b'\n'),
                        b'r' => out.push(b'\r'),
                        b't' => out.push(b'\t'),
                        b'u' => self.unicode_escape(out)?,
                        _ => return Err(ScanError::Syntax(self.i - 1)),
                    }
                }
                c => {
                    out.push(c);
                    let run_end = find_quote_or_backslash(self.b, self.i);
                    out.extend_from_slice(&self.b[self.i..run_end]);
                    self.i = run_end;
                }
            }
        }
    }

    /// Decodes `XXXX` after `\u` (and a following low surrogate), appending UTF-8; a lone
    /// surrogate is appended as its generalised UTF-8 bytes (see [`Scanner::string`]).
    fn unicode_escape(&mut self, out: &mut Vec<u8>) -> Result<(), ScanError> {
        let hi = self.hex4()?;
        let mut code = hi;
        if (0xD800..0xDC00).contains(&hi) && self.b.get(self.i..self.i + 2) == Some(b"\\u") {
            let save = self.i;
            self.i += 2;
            let lo = self.hex4()?;
            if (0xDC00..0xE000).contains(&lo) {
                code = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
            } else {
                // Not a pair: this escape stands alone and the next one is read on its own.
                self.i = save;
            }
        }
        match char::from_u32(code) {
            Some(ch) => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
            }
            // Only a lone surrogate (U+D800..U+DFFF) is no `char`: four hex digits cannot
            // exceed U+FFFF, and a combined pair is always a valid code point.
            None => out.extend_from_slice(&generalised_utf8_3(code)),
        }
        Ok(())
    }

    fn hex4(&mut self) -> Result<u32, ScanError> {
        let mut v = 0u32;
        for _ in 0..4 {
            let c = self.next_byte()?;
            let d = (c as char)
                .to_digit(16)
                .ok_or(ScanError::Syntax(self.i - 1))?;
            v = (v << 4) | d;
        }
        Ok(v)
    }

    /// Skips one value of any type, checking its structure, without recursion.
    pub(crate) fn skip_value(&mut self) -> Result<(), ScanError> {
        let mut stack = BitStack::default();
        loop {
            // At the start of a value.
            self.skip_ws();
            match self.peek() {
                Some(b'{') => {
                    self.i += 1;
                    self.skip_ws();
                    if self.peek() == Some(b'}') {
                        self.i += 1;
                    } else {
                        stack.push(true);
                        self.member_name()?;
                        continue;
                    }
                }
                Some(b'[') => {
                    self.i += 1;
                    self.skip_ws();
                    if self.peek() == Some(b']') {
                        self.i += 1;
                    } else {
                        stack.push(false);
                        continue;
                    }
                }
                Some(b'"') => self.skip_string()?,
                Some(_) => {
                    self.value()?;
                }
                None => return Err(self.err()),
            }
            // After a complete value: close containers or move to the next element.
            loop {
                let Some(in_object) = stack.top() else {
                    return Ok(());
                };
                self.skip_ws();
                match (self.next_byte()?, in_object) {
                    (b',', true) => {
                        self.skip_ws();
                        self.member_name()?;
                        break;
                    }
                    (b',', false) => break,
                    (b'}', true) | (b']', false) => stack.pop(),
                    _ => return Err(ScanError::Syntax(self.i - 1)),
                }
            }
        }
    }

    /// Skips `"name" :` inside an object being skipped.
    fn member_name(&mut self) -> Result<(), ScanError> {
        if self.peek() != Some(b'"') {
            return Err(self.err());
        }
        self.skip_string()?;
        self.skip_ws();
        self.expect(b':')
    }

    /// Skips a string without unescaping it (escapes are still checked for shape).
    pub(crate) fn skip_string(&mut self) -> Result<(), ScanError> {
        self.expect(b'"')?;
        loop {
            self.i = find_quote_or_backslash(self.b, self.i);
            match self.next_byte()? {
                b'"' => return Ok(()),
                _ => match self.next_byte()? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                    b'u' => {
                        self.hex4()?;
                    }
                    _ => return Err(ScanError::Syntax(self.i - 1)),
                },
            }
        }
    }
}

/// The three-byte UTF-8 form of a code point in U+0800..=U+FFFF, surrogates included (which
/// strict UTF-8 forbids and Python's `surrogatepass` writes).
fn generalised_utf8_3(code: u32) -> [u8; 3] {
    [
        0xE0 | (code >> 12 & 0x0F) as u8,
        0x80 | (code >> 6 & 0x3F) as u8,
        0x80 | (code & 0x3F) as u8,
    ]
}

/// Index of the first `"` or `\` at or after `from`, or `b.len()`.
///
/// Eight bytes at a time: `has_zero_byte(x ^ splat(c))` flags words containing byte `c`.
#[inline]
fn find_quote_or_backslash(b: &[u8], from: usize) -> usize {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    const QUOTE: u64 = LO * b'"' as u64;
    const BACKSLASH: u64 = LO * b'\\' as u64;
    let mut i = from;
    while let Some(chunk) = b.get(i..i + 8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(chunk);
        let x = u64::from_le_bytes(w);
        let q = x ^ QUOTE;
        let s = x ^ BACKSLASH;
        let hit = (q.wrapping_sub(LO) & !q | s.wrapping_sub(LO) & !s) & HI;
        if hit != 0 {
            // The lowest flagged byte is exact (borrows only propagate upwards).
            return i + (hit.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while let Some(&c) = b.get(i) {
        if c == b'"' || c == b'\\' {
            return i;
        }
        i += 1;
    }
    b.len()
}

/// A stack of booleans (true = object, false = array), one bit per level.
#[derive(Default)]
struct BitStack {
    words: Vec<u64>,
    len: usize,
}

impl BitStack {
    fn push(&mut self, bit: bool) {
        let (w, b) = (self.len / 64, self.len % 64);
        if w == self.words.len() {
            self.words.push(0);
        }
        if let Some(word) = self.words.get_mut(w) {
            if bit {
                *word |= 1 << b;
            } else {
                *word &= !(1 << b);
            }
        }
        self.len += 1;
    }

    fn top(&self) -> Option<bool> {
        let n = self.len.checked_sub(1)?;
        self.words.get(n / 64).map(|w| w >> (n % 64) & 1 == 1)
    }

    fn pop(&mut self) {
        self.len = self.len.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(body: &str, wanted: &[&str]) -> Result<Vec<(usize, Value<'static>)>, ScanError> {
        let owned: &'static [u8] = Box::leak(body.as_bytes().to_vec().into_boxed_slice());
        let mut out = Vec::new();
        scan_top_level(owned, wanted, |i, v| out.push((i, v)))?;
        Ok(out)
    }

    fn s(x: &str) -> Value<'static> {
        Value::Str(Cow::Owned(x.as_bytes().to_vec()))
    }

    #[test]
    fn finds_top_level_fields_of_every_type() {
        let body = r#"{"model":"m","routing_key":"abc","routed_dp_rank":3,"user":null,
            "a":true,"b":false,"o":{"x":1},"arr":[1,2]}"#;
        let got = scan(
            body,
            &[
                "routing_key",
                "routed_dp_rank",
                "user",
                "a",
                "b",
                "o",
                "arr",
            ],
        );
        assert_eq!(
            got.unwrap(),
            vec![
                (0, s("abc")),
                (1, Value::Number(b"3")),
                (2, Value::Null),
                (3, Value::Bool(true)),
                (4, Value::Bool(false)),
                (5, Value::Object),
                (6, Value::Array),
            ]
        );
    }

    #[test]
    fn ignores_decoys_nested_or_inside_strings() {
        let body = r#"{"messages":[{"role":"user","content":"\"routing_key\":\"evil\"",
            "routing_key":"nested"}],"meta":{"routing_key":"deeper"},"routing_key":"real"}"#;
        assert_eq!(scan(body, &["routing_key"]).unwrap(), vec![(0, s("real"))]);
    }

    #[test]
    fn unescapes_wanted_strings_and_names() {
        let body = r#"{"routing\u005fkey":"a\"b\\c\/\n\u00e9\ud83d\ude00x"}"#;
        assert_eq!(
            scan(body, &["routing_key"]).unwrap(),
            vec![(0, s("a\"b\\c/\né😀x"))]
        );
    }

    fn bytes(x: &[u8]) -> Value<'static> {
        Value::Str(Cow::Owned(x.to_vec()))
    }

    /// Each escape against the bytes of Python 3.11's
    /// `json.loads(b'{"k":"<escape>"}')["k"].encode("utf-8", "surrogatepass")`.
    #[test]
    fn lone_surrogates_become_the_bytes_python_encodes() {
        let cases: [(&str, &[u8]); 9] = [
            (r"\ud800", b"\xed\xa0\x80"),
            (r"\udc00x", b"\xed\xb0\x80x"),
            (r"\udfff", b"\xed\xbf\xbf"),
            (r"\ud83d\ude00", "😀".as_bytes()),
            // A high surrogate followed by an escape that is not a low one: both stand alone.
            (r"\ud800\u0041", b"\xed\xa0\x80A"),
            (r"\ud800\ud800\udc00", b"\xed\xa0\x80\xf0\x90\x80\x80"),
            // A low surrogate before a high one is no pair.
            (r"\udc00\ud800", b"\xed\xb0\x80\xed\xa0\x80"),
            (r"\ud800\n", b"\xed\xa0\x80\n"),
            (r"\uFFFD", "\u{FFFD}".as_bytes()),
        ];
        for (escape, want) in cases {
            let body = format!(r#"{{"k":"{escape}"}}"#);
            assert_eq!(
                scan(&body, &["k"]).unwrap(),
                vec![(0, bytes(want))],
                "{escape}"
            );
        }
        // Distinct lone surrogates are distinct keys (no shared replacement character), and a raw
        // `ED A0 80` in the body, which Python decodes to the same lone surrogate, is equal.
        let raw: &'static [u8] = b"{\"k\":\"\xed\xa0\x80\"}";
        let mut got = Vec::new();
        scan_top_level(raw, &["k"], |_, v| got.push(v)).unwrap();
        assert_eq!(got, vec![bytes(b"\xed\xa0\x80")]);
        let broken = [r#"{"k":"\ud800\u12"}"#, r#"{"k":"\ud800\uZZZZ"}"#];
        for body in broken {
            assert!(scan(body, &["k"]).is_err(), "{body}");
        }
    }

    /// Bodies Python 3.11's `json.loads(bytes)` reads (checked there), and the value it sees.
    #[test]
    fn accepts_what_python_json_accepts() {
        let cases: [(&[u8], Value<'static>); 8] = [
            (b"\xEF\xBB\xBF{\"k\":\"a\"}", s("a")),
            (b"\xEF\xBB\xBF \n{\"k\":\"a\"}", s("a")),
            (b"{\"t\":NaN,\"k\":\"a\"}", s("a")),
            (b"{\"k\":NaN}", Value::Number(b"NaN")),
            (b"{\"k\":Infinity}", Value::Number(b"Infinity")),
            (b"{\"k\":-Infinity}", Value::Number(b"-Infinity")),
            (b"{\"k\":[NaN,-Infinity,{\"x\":Infinity}]}", Value::Array),
            (b"{\"k\":\"a\",\"k\":\"b\"}", s("b")),
        ];
        for (body, want) in cases {
            let mut last = None;
            let got = scan_top_level(body, &["k"], |_, v| last = Some(v));
            assert_eq!(got, Ok(()), "{}", String::from_utf8_lossy(body));
            assert_eq!(last, Some(want), "{}", String::from_utf8_lossy(body));
        }
        assert_eq!(bom_len(b"\xEF\xBB\xBF{}"), 3);
        assert_eq!(bom_len(b" \xEF\xBB\xBF{}"), 0);
        assert_eq!(bom_len(b"\xEF\xBB"), 0);
    }

    /// Bodies Python 3.11's `json.loads(bytes)` refuses too: its extensions stop exactly there.
    #[test]
    fn refuses_what_python_json_refuses_near_its_extensions() {
        let bad: [&[u8]; 12] = [
            b" \xEF\xBB\xBF{}",
            b"\xEF\xBB\xBF\xEF\xBB\xBF{}",
            b"{}\xEF\xBB\xBF",
            b"\xEF\xBB{}",
            b"{\"k\":-NaN}",
            b"{\"k\":+Infinity}",
            b"{\"k\":nan}",
            b"{\"k\":infinity}",
            b"{\"k\":NaN1}",
            b"{\"k\":Infinityx}",
            b"{\"k\":Infinit}",
            b"{\"k\":[Na]}",
        ];
        for body in bad {
            let got = scan_top_level(body, &["k"], |_, _| {});
            assert!(got.is_err(), "accepted {}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn reports_duplicates_in_order() {
        let got = scan(r#"{"k":1,"k":2}"#, &["k"]).unwrap();
        assert_eq!(
            got,
            vec![(0, Value::Number(b"1")), (0, Value::Number(b"2"))]
        );
    }

    #[test]
    fn rejects_malformed_input() {
        let bad = [
            "",
            " ",
            "[]",
            "\"x\"",
            "{",
            "{\"a\"",
            "{\"a\":",
            "{\"a\":1",
            "{\"a\":1,}",
            "{\"a\" 1}",
            "{a:1}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":-}",
            "{\"a\":1e}",
            "{\"a\":tru}",
            "{\"a\":[1,]}",
            "{\"a\":[1}",
            "{\"a\":{\"b\"}}",
            "{\"a\":{\"b\":1]}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12g4\"}",
            "{\"a\":1}x",
            "{\"a\":1}}",
            "{\"a\":\"unterminated}",
        ];
        for b in bad {
            assert!(scan(b, &["a"]).is_err(), "accepted {b:?}");
        }
    }

    #[test]
    fn accepts_valid_edge_cases() {
        let good = [
            "{}",
            " { } ",
            "{\"a\":[]}",
            "{\"a\":[[],{}]}",
            "{\"a\":-0.5e+10}",
            "{\"a\":\"\"}",
            "{\"a\":{\"b\":[1,{\"c\":\"\\u0041\"}]}}",
        ];
        for b in good {
            assert!(scan(b, &["zz"]).is_ok(), "rejected {b:?}");
        }
    }

    #[test]
    fn deep_nesting_does_not_recurse() {
        let depth = 100_000;
        let mut body = String::from("{\"a\":");
        body.push_str(&"[".repeat(depth));
        body.push_str(&"]".repeat(depth));
        body.push_str(",\"k\":\"v\"}");
        assert_eq!(scan(&body, &["k"]).unwrap(), vec![(0, s("v"))]);
        let unbalanced = format!("{{\"a\":{}}}", "[".repeat(depth));
        assert!(scan(&unbalanced, &["k"]).is_err());
    }

    #[test]
    fn quote_finder_agrees_with_naive_search() {
        let hay: Vec<u8> = (0..200u32).map(|i| (i * 37 % 251) as u8).collect();
        for from in 0..hay.len() {
            let naive = hay[from..]
                .iter()
                .position(|&c| c == b'"' || c == b'\\')
                .map_or(hay.len(), |p| from + p);
            assert_eq!(find_quote_or_backslash(&hay, from), naive, "from {from}");
        }
    }

    #[test]
    fn agrees_with_serde_on_top_level_strings() {
        let body = r#"{"x":{"y":[1,"\"z"]},"routing_key":"k\t\u2603","n":12.5e-3}"#;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        let got = scan(body, &["routing_key", "n"]).unwrap();
        assert_eq!(
            got[0].1,
            s(v["routing_key"].as_str().unwrap()),
            "string value as serde sees it"
        );
        assert_eq!(got[1].1, Value::Number(b"12.5e-3"));
    }
}
