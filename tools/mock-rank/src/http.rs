//! Minimal HTTP/1.1 server side: request parsing (Content-Length and chunked
//! bodies, keep-alive rules) and response writing (fixed-length and chunked).
//!
//! Everything here is generic over `BufRead`/`Write` so it can be unit tested
//! on in-memory buffers. Malformed input yields `ReadError::Bad`, never a panic:
//! the workspace release profile uses `panic = "abort"`, so a panic in any
//! connection thread would take the whole mock down mid-test.

use std::io::{self, BufRead, Read, Write};

/// Longest request line / header line / chunk-size line we accept.
pub const MAX_LINE_BYTES: u64 = 64 * 1024;
/// Most header (or trailer) lines per request.
pub const MAX_HEADER_COUNT: usize = 256;
/// Largest body we buffer. Far above the filter's 8 MiB body limit so that
/// oversized bodies the filter passes through still reach the mock intact.
pub const MAX_BODY_BYTES: u64 = 256 * 1024 * 1024;
/// Empty lines tolerated before a request line (RFC 9112 section 2.2: some
/// clients send a stray CRLF after a POST body).
const MAX_LEADING_EMPTY_LINES: usize = 8;

#[derive(Debug)]
pub enum ReadError {
    /// Peer closed the connection cleanly between requests.
    Closed,
    /// Malformed request: answer 400 and close.
    Bad(String),
    /// Body larger than `MAX_BODY_BYTES`: answer 413 and close.
    TooLarge,
    /// Transport failure or EOF in the middle of a request: nobody to answer.
    Io(io::Error),
}

impl From<io::Error> for ReadError {
    fn from(err: io::Error) -> Self {
        ReadError::Io(err)
    }
}

fn bad(msg: &str) -> ReadError {
    ReadError::Bad(msg.to_string())
}

fn truncated() -> ReadError {
    ReadError::Io(io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "connection closed mid-request",
    ))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Empty,
    Length(u64),
    Chunked,
}

#[derive(Debug)]
pub struct Head {
    pub method: String,
    /// Request target exactly as received (path plus optional query).
    pub target: String,
    pub http10: bool,
    /// Header names lower-cased, values lossily decoded, in arrival order.
    pub headers: Vec<(String, String)>,
    pub framing: Framing,
    /// Whether the connection may serve another request after this one.
    pub keep_alive: bool,
    pub expect_continue: bool,
}

impl Head {
    /// The path part of the target, used for routing.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or(&self.target)
    }
}

#[derive(Debug)]
pub struct Request {
    pub head: Head,
    pub body: Vec<u8>,
}

/// Reads one line terminated by LF (CR before it is dropped). `Ok(None)` means
/// EOF before any byte.
fn read_line<R: BufRead>(r: &mut R) -> Result<Option<Vec<u8>>, ReadError> {
    let mut line = Vec::new();
    let n = r
        .by_ref()
        .take(MAX_LINE_BYTES)
        .read_until(b'\n', &mut line)?;
    if n == 0 {
        return Ok(None);
    }
    if line.last() != Some(&b'\n') {
        return Err(if n as u64 >= MAX_LINE_BYTES {
            bad("line too long")
        } else {
            truncated()
        });
    }
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Ok(Some(line))
}

/// Reads the request line and headers. `ReadError::Closed` if the peer hung up
/// before starting a new request (the normal end of a keep-alive connection).
pub fn read_head<R: BufRead>(r: &mut R) -> Result<Head, ReadError> {
    let line = read_request_line(r)?;
    let (method, target, http10) = parse_request_line(&line)?;
    let headers = read_header_lines(r)?;
    let (framing, framing_forces_close) = framing(&headers)?;
    let connection = tokens(&headers, "connection");
    let keep_alive = !framing_forces_close
        && if http10 {
            connection.iter().any(|t| t == "keep-alive")
        } else {
            !connection.iter().any(|t| t == "close")
        };
    let expect_continue = !http10
        && framing != Framing::Empty
        && tokens(&headers, "expect")
            .iter()
            .any(|t| t == "100-continue");
    Ok(Head {
        method,
        target,
        http10,
        headers,
        framing,
        keep_alive,
        expect_continue,
    })
}

fn read_request_line<R: BufRead>(r: &mut R) -> Result<Vec<u8>, ReadError> {
    for _ in 0..=MAX_LEADING_EMPTY_LINES {
        match read_line(r)? {
            None => return Err(ReadError::Closed),
            Some(line) if line.is_empty() => continue,
            Some(line) => return Ok(line),
        }
    }
    Err(bad("too many empty lines before request line"))
}

fn parse_request_line(line: &[u8]) -> Result<(String, String, bool), ReadError> {
    let text = std::str::from_utf8(line).map_err(|_| bad("request line is not UTF-8"))?;
    let mut parts = text.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad("malformed request line"));
    };
    if method.is_empty() || !method.bytes().all(is_tchar) {
        return Err(bad("malformed method"));
    }
    if target.is_empty() || target.bytes().any(|b| b.is_ascii_control()) {
        return Err(bad("malformed request target"));
    }
    let http10 = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        _ => return Err(bad("unsupported HTTP version")),
    };
    Ok((method.to_string(), target.to_string(), http10))
}

/// Header or trailer lines up to the empty line.
fn read_header_lines<R: BufRead>(r: &mut R) -> Result<Vec<(String, String)>, ReadError> {
    let mut headers = Vec::new();
    loop {
        let line = read_line(r)?.ok_or_else(truncated)?;
        if line.is_empty() {
            return Ok(headers);
        }
        if headers.len() >= MAX_HEADER_COUNT {
            return Err(bad("too many header lines"));
        }
        headers.push(parse_header_line(&line)?);
    }
}

fn parse_header_line(line: &[u8]) -> Result<(String, String), ReadError> {
    if matches!(line.first(), Some(b' ' | b'\t')) {
        // Obsolete line folding; RFC 9112 lets servers reject it.
        return Err(bad("obsolete header line folding"));
    }
    let colon = line
        .iter()
        .position(|&b| b == b':')
        .ok_or_else(|| bad("header line without colon"))?;
    let (name, rest) = line.split_at(colon);
    if name.is_empty() || !name.iter().copied().all(is_tchar) {
        return Err(bad("malformed header name"));
    }
    let value = trim_ows(rest.get(1..).unwrap_or_default());
    Ok((
        String::from_utf8_lossy(name).to_ascii_lowercase(),
        String::from_utf8_lossy(value).into_owned(),
    ))
}

fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

/// RFC 9110 token characters (method and header names).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Lower-cased comma-separated tokens of every `name` header.
fn tokens(headers: &[(String, String)], name: &str) -> Vec<String> {
    headers
        .iter()
        .filter(|(n, _)| n == name)
        .flat_map(|(_, v)| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

/// Body framing per RFC 9112 section 6.3. The bool asks to close the
/// connection afterwards: a request carrying both Transfer-Encoding and
/// Content-Length is processed as chunked, but the connection is not reused
/// because the two could disagree about where the next request starts.
fn framing(headers: &[(String, String)]) -> Result<(Framing, bool), ReadError> {
    let codings = tokens(headers, "transfer-encoding");
    let lengths = tokens(headers, "content-length");
    if !codings.is_empty() {
        // Only "chunked" alone is decodable here; anything else is refused
        // rather than misread.
        if codings != ["chunked"] {
            return Err(bad("unsupported transfer-encoding"));
        }
        return Ok((Framing::Chunked, !lengths.is_empty()));
    }
    let Some(first) = lengths.first() else {
        return Ok((Framing::Empty, false));
    };
    if lengths.iter().any(|l| l != first) {
        return Err(bad("conflicting content-length values"));
    }
    if !first.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("invalid content-length"));
    }
    // Only overflow can fail here: the value is all digits and non-empty.
    let len = first.parse().map_err(|_| ReadError::TooLarge)?;
    let framing = if len == 0 {
        Framing::Empty
    } else {
        Framing::Length(len)
    };
    Ok((framing, false))
}

/// Reads the body announced by `framing`, keeping the exact bytes.
pub fn read_body<R: BufRead>(r: &mut R, framing: Framing) -> Result<Vec<u8>, ReadError> {
    match framing {
        Framing::Empty => Ok(Vec::new()),
        Framing::Length(len) => read_sized(r, len),
        Framing::Chunked => read_chunked(r),
    }
}

fn read_sized<R: BufRead>(r: &mut R, len: u64) -> Result<Vec<u8>, ReadError> {
    if len > MAX_BODY_BYTES {
        return Err(ReadError::TooLarge);
    }
    let mut body = Vec::new();
    append_exact(r, len, &mut body)?;
    Ok(body)
}

/// Appends exactly `len` bytes from `r` to `out`.
fn append_exact<R: BufRead>(r: &mut R, len: u64, out: &mut Vec<u8>) -> Result<(), ReadError> {
    let got = r.by_ref().take(len).read_to_end(out)?;
    if got as u64 != len {
        return Err(truncated());
    }
    Ok(())
}

fn read_chunked<R: BufRead>(r: &mut R) -> Result<Vec<u8>, ReadError> {
    let mut body = Vec::new();
    loop {
        let line = read_line(r)?.ok_or_else(truncated)?;
        let size = parse_chunk_size(&line)?;
        if size == 0 {
            // Trailers are read only to find the end of the message.
            read_header_lines(r)?;
            return Ok(body);
        }
        if (body.len() as u64).saturating_add(size) > MAX_BODY_BYTES {
            return Err(ReadError::TooLarge);
        }
        append_exact(r, size, &mut body)?;
        match read_line(r)? {
            Some(line) if line.is_empty() => {}
            Some(_) => return Err(bad("missing CRLF after chunk data")),
            None => return Err(truncated()),
        }
    }
}

/// `1a;ext=1` → 26. Chunk extensions are ignored.
fn parse_chunk_size(line: &[u8]) -> Result<u64, ReadError> {
    let digits = trim_ows(line.split(|&b| b == b';').next().unwrap_or(line));
    if digits.is_empty() || digits.len() > 16 || !digits.iter().all(u8::is_ascii_hexdigit) {
        return Err(bad("invalid chunk size"));
    }
    let text = String::from_utf8_lossy(digits);
    u64::from_str_radix(&text, 16).map_err(|_| bad("invalid chunk size"))
}

/// How a response must be framed for the request it answers.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// Sent as `x-dp-rank`; `None` (engine mode, request not dispatched to an
    /// internal rank) sends no such header.
    pub rank: Option<u32>,
    pub keep_alive: bool,
    /// HEAD request: send headers only.
    pub head_only: bool,
    /// HTTP/1.0 peers cannot read chunked responses.
    pub chunked_ok: bool,
    /// Further headers, sent after `x-dp-rank` (names lower-case).
    pub extra_headers: Vec<(&'static str, String)>,
}

impl ResponseMeta {
    pub fn for_request(rank: Option<u32>, head: &Head) -> Self {
        ResponseMeta {
            rank,
            keep_alive: head.keep_alive,
            head_only: head.method == "HEAD",
            chunked_ok: !head.http10,
            extra_headers: Vec::new(),
        }
    }

    /// For errors found while parsing: there is no trustworthy request, so
    /// answer and close.
    pub fn closing(rank: Option<u32>) -> Self {
        ResponseMeta {
            rank,
            keep_alive: false,
            head_only: false,
            chunked_ok: true,
            extra_headers: Vec::new(),
        }
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Content Too Large",
        _ => "Unknown",
    }
}

/// `keep_alive` is passed apart from `meta` because a stream that cannot be
/// chunked must close even if the request allowed reuse.
fn write_status_and_common<W: Write>(
    w: &mut W,
    status: u16,
    content_type: &str,
    meta: &ResponseMeta,
    keep_alive: bool,
) -> io::Result<()> {
    let connection = if keep_alive { "keep-alive" } else { "close" };
    write!(
        w,
        "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\n",
        reason(status)
    )?;
    if let Some(rank) = meta.rank {
        write!(w, "x-dp-rank: {rank}\r\n")?;
    }
    for (name, value) in &meta.extra_headers {
        write!(w, "{name}: {value}\r\n")?;
    }
    write!(w, "connection: {connection}\r\n")
}

/// Writes a complete fixed-length response and flushes. Returns whether the
/// connection may be reused.
pub fn write_response<W: Write>(
    w: &mut W,
    meta: &ResponseMeta,
    status: u16,
    content_type: &str,
    body: &[u8],
) -> io::Result<bool> {
    write_status_and_common(w, status, content_type, meta, meta.keep_alive)?;
    write!(w, "content-length: {}\r\n\r\n", body.len())?;
    if !meta.head_only {
        w.write_all(body)?;
    }
    w.flush()?;
    Ok(meta.keep_alive)
}

pub fn write_continue<W: Write>(w: &mut W) -> io::Result<()> {
    w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
    w.flush()
}

/// A 200 response whose body is sent piece by piece, each piece flushed as its
/// own chunk so the client sees it immediately.
pub struct BodyStream<'a, W: Write> {
    w: &'a mut W,
    chunked: bool,
    keep_alive: bool,
}

impl<'a, W: Write> BodyStream<'a, W> {
    pub fn start(w: &'a mut W, meta: &ResponseMeta, content_type: &str) -> io::Result<Self> {
        // Without chunking the body ends at connection close, so no reuse.
        let chunked = meta.chunked_ok;
        let keep_alive = meta.keep_alive && chunked;
        write_status_and_common(w, 200, content_type, meta, keep_alive)?;
        w.write_all(b"cache-control: no-cache\r\n")?;
        if chunked {
            w.write_all(b"transfer-encoding: chunked\r\n")?;
        }
        w.write_all(b"\r\n")?;
        w.flush()?;
        Ok(BodyStream {
            w,
            chunked,
            keep_alive,
        })
    }

    pub fn send(&mut self, data: &[u8]) -> io::Result<()> {
        // An empty chunk would mean end-of-body.
        if data.is_empty() {
            return Ok(());
        }
        if self.chunked {
            write!(self.w, "{:x}\r\n", data.len())?;
            self.w.write_all(data)?;
            self.w.write_all(b"\r\n")?;
        } else {
            self.w.write_all(data)?;
        }
        self.w.flush()
    }

    /// Ends the body. Returns whether the connection may be reused.
    pub fn finish(self) -> io::Result<bool> {
        if self.chunked {
            self.w.write_all(b"0\r\n\r\n")?;
        }
        self.w.flush()?;
        Ok(self.keep_alive)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn read_request(input: &mut Cursor<Vec<u8>>) -> Result<Request, ReadError> {
        let head = read_head(input)?;
        let body = read_body(input, head.framing)?;
        Ok(Request { head, body })
    }

    fn cursor(text: &str) -> Cursor<Vec<u8>> {
        Cursor::new(text.as_bytes().to_vec())
    }

    #[test]
    fn content_length_body() {
        let mut input = cursor(
            "POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nX-Test:  v  \r\n\r\nhelloEXTRA",
        );
        let req = read_request(&mut input).expect("valid request");
        assert_eq!(req.head.method, "POST");
        assert_eq!(req.head.target, "/v1/completions?x=1");
        assert_eq!(req.head.path(), "/v1/completions");
        assert!(req.head.headers.contains(&("x-test".into(), "v".into())));
        assert_eq!(req.body, b"hello");
        assert!(req.head.keep_alive);
    }

    #[test]
    fn chunked_body_with_extensions_and_trailers() {
        let mut input = cursor(
            "POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
             4;ext=1\r\nabcd\r\nA\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n",
        );
        let req = read_request(&mut input).expect("valid chunked request");
        assert_eq!(req.body, b"abcd0123456789");
        assert!(req.head.keep_alive);
    }

    #[test]
    fn keep_alive_rules() {
        let head = |text: &str| read_head(&mut cursor(text)).expect("valid head");
        assert!(head("GET / HTTP/1.1\r\n\r\n").keep_alive);
        assert!(!head("GET / HTTP/1.1\r\nConnection: close\r\n\r\n").keep_alive);
        assert!(!head("GET / HTTP/1.0\r\n\r\n").keep_alive);
        assert!(head("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive);
        // Both framings present: processed as chunked, then the connection closes.
        let h = head("POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(h.framing, Framing::Chunked);
        assert!(!h.keep_alive);
    }

    #[test]
    fn pipelined_requests_then_clean_eof() {
        let mut input = cursor(
            "POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nxy\r\n\
             GET /b HTTP/1.1\r\n\r\n",
        );
        assert_eq!(read_request(&mut input).expect("first").body, b"xy");
        assert_eq!(read_request(&mut input).expect("second").head.target, "/b");
        assert!(matches!(read_request(&mut input), Err(ReadError::Closed)));
    }

    #[test]
    fn expect_continue_only_with_body() {
        let text = "POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n";
        assert!(read_head(&mut cursor(text)).expect("head").expect_continue);
        let text = "GET / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n";
        assert!(!read_head(&mut cursor(text)).expect("head").expect_continue);
    }

    #[test]
    fn malformed_requests_are_bad() {
        let cases = [
            "GARBAGE\r\n\r\n",
            "GET /\r\n\r\n",
            "GET / HTTP/2.0\r\n\r\n",
            "GET / HTTP/1.1\r\nno colon\r\n\r\n",
            "GET / HTTP/1.1\r\nbad name: v\r\n\r\n",
            "GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
        ];
        for case in cases {
            let result = read_request(&mut cursor(case));
            assert!(matches!(result, Err(ReadError::Bad(_))), "{case:?}");
        }
    }

    #[test]
    fn truncated_and_oversized() {
        let result = read_request(&mut cursor(
            "POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nab",
        ));
        assert!(matches!(result, Err(ReadError::Io(_))));
        let huge = format!(
            "POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_BYTES + 1
        );
        assert!(matches!(
            read_request(&mut cursor(&huge)),
            Err(ReadError::TooLarge)
        ));
        let overflow = "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n";
        assert!(matches!(
            read_request(&mut cursor(overflow)),
            Err(ReadError::TooLarge)
        ));
        let long_line = format!(
            "GET /{} HTTP/1.1\r\n\r\n",
            "a".repeat(MAX_LINE_BYTES as usize)
        );
        assert!(matches!(
            read_request(&mut cursor(&long_line)),
            Err(ReadError::Bad(_))
        ));
    }

    #[test]
    fn chunked_response_framing() {
        let meta = ResponseMeta::closing(Some(2));
        let mut out = Vec::new();
        let mut stream = BodyStream::start(&mut out, &meta, "text/event-stream").expect("start");
        stream.send(b"data: x\n\n").expect("send");
        stream.send(b"").expect("empty send is skipped");
        assert!(!stream.finish().expect("finish"));
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(text.contains("x-dp-rank: 2\r\n"));
        assert!(text.contains("transfer-encoding: chunked\r\n"));
        assert!(text.ends_with("\r\n\r\n9\r\ndata: x\n\n\r\n0\r\n\r\n"));
    }

    #[test]
    fn extra_headers_follow_the_rank() {
        let mut meta = ResponseMeta::closing(Some(1));
        meta.extra_headers = vec![("x-a", "1".into()), ("x-b", "two".into())];
        let mut out = Vec::new();
        write_response(&mut out, &meta, 200, "text/plain", b"").expect("write");
        let text = String::from_utf8(out).expect("utf8");
        assert!(
            text.contains("x-dp-rank: 1\r\nx-a: 1\r\nx-b: two\r\nconnection: close\r\n"),
            "{text}"
        );
        let mut out = Vec::new();
        BodyStream::start(&mut out, &meta, "text/event-stream").expect("start");
        assert!(String::from_utf8(out)
            .expect("utf8")
            .contains("x-b: two\r\n"));
    }

    #[test]
    fn rank_header_only_when_known() {
        let mut out = Vec::new();
        write_response(
            &mut out,
            &ResponseMeta::closing(None),
            200,
            "text/plain",
            b"ok",
        )
        .expect("write");
        let text = String::from_utf8(out).expect("utf8");
        assert!(!text.contains("x-dp-rank"), "{text}");
        assert!(text.contains("connection: close\r\ncontent-length: 2\r\n\r\nok"));
    }
}
