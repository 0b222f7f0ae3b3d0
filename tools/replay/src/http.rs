//! A minimal HTTP/1.1 client over `std::net`, just enough to replay requests
//! against Envoy or the mock: POST with a fixed-length JSON body, keep-alive
//! connections, answers framed by Content-Length, chunked transfer coding or
//! connection close, and one deadline per request covering connect, write and
//! read. No crate: the tool stays std + serde_json, and every byte timing
//! (first response byte, total) is ours to measure.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Largest response body kept; more is an error (a runaway stream).
const MAX_BODY_BYTES: u64 = 64 * 1024 * 1024;
/// Longest status or header line.
const MAX_LINE_BYTES: usize = 64 * 1024;
const MAX_HEADERS: usize = 256;

/// A target: `http://host:port[/base]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port`, for connecting and the Host header.
    pub authority: String,
    /// Path prefix without a trailing slash ("" for none).
    pub base: String,
}

impl Target {
    pub fn parse(url: &str) -> Result<Target, String> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("{url:?}: expected http://HOST:PORT"))?;
        let (authority, base) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| format!("{url:?}: expected an explicit :PORT"))?;
        if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(format!(
                "{url:?}: expected http://HOST:PORT with PORT in 1..65535"
            ));
        }
        if base.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(format!("{url:?}: invalid path"));
        }
        Ok(Target {
            authority: authority.to_string(),
            base: base.to_string(),
        })
    }
}

/// A parsed response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    /// Lower-cased names, values trimmed, in order.
    pub headers: Vec<(String, String)>,
    /// The body with the transfer coding removed.
    pub body: Vec<u8>,
    /// Whether the connection may carry another request.
    pub keep_alive: bool,
}

impl Response {
    /// The first value of header `name` (lower-case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A stream whose every read and write is bounded by one deadline.
#[derive(Debug)]
pub struct DeadlineStream {
    stream: TcpStream,
    deadline: Instant,
}

impl DeadlineStream {
    fn remaining(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        Ok(left)
    }
}

/// Socket timeouts surface as `WouldBlock` on Unix: call them what they are.
fn timed_out(err: io::Error) -> io::Error {
    match err.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            io::Error::new(io::ErrorKind::TimedOut, "timed out")
        }
        _ => err,
    }
}

impl Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.remaining()?))?;
        self.stream.read(buf).map_err(timed_out)
    }
}

impl Write for DeadlineStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.remaining()?))?;
        self.stream.write(buf).map_err(timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// An open connection, reusable while the server keeps it alive.
#[derive(Debug)]
pub struct Conn {
    reader: BufReader<DeadlineStream>,
    /// Requests already answered on this connection.
    pub served: u64,
}

impl Conn {
    pub fn connect(target: &Target, deadline: Instant) -> io::Result<Conn> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"));
        }
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
        for addr in target.authority.to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, left) {
                Ok(stream) => {
                    // Requests are written in one go; do not wait for ACKs.
                    stream.set_nodelay(true)?;
                    let stream = DeadlineStream { stream, deadline };
                    return Ok(Conn {
                        reader: BufReader::with_capacity(64 * 1024, stream),
                        served: 0,
                    });
                }
                Err(err) => last = err,
            }
        }
        Err(last)
    }

    /// Sets the deadline of the next exchange.
    pub fn set_deadline(&mut self, deadline: Instant) {
        self.reader.get_mut().deadline = deadline;
    }

    /// Writes a whole request at once.
    pub fn send(&mut self, request: &[u8]) -> io::Result<()> {
        let stream = self.reader.get_mut();
        stream.write_all(request)?;
        stream.flush()
    }

    /// Blocks until the first response byte is available.
    pub fn wait_first_byte(&mut self) -> io::Result<()> {
        if self.reader.fill_buf()?.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before any response",
            ));
        }
        Ok(())
    }

    pub fn read_response(&mut self) -> io::Result<Response> {
        let response = read_response(&mut self.reader)?;
        self.served += 1;
        Ok(response)
    }
}

/// The bytes of a POST request with a JSON body.
pub fn post(target: &Target, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 256);
    out.extend_from_slice(
        format!(
            "POST {}{path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\naccept: application/json, text/event-stream\r\ncontent-length: {}\r\n",
            target.base,
            target.authority,
            body.len()
        )
        .as_bytes(),
    );
    for (name, value) in headers {
        out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// Whether `value` can be sent as a header value as-is (visible ASCII and
/// inner spaces; no CR/LF that would split the request).
pub fn valid_header_value(value: &str) -> bool {
    value == value.trim()
        && value
            .bytes()
            .all(|b| b == b' ' || b == b'\t' || (0x21..0x7f).contains(&b))
}

/// RFC 9110 token (header names).
pub fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// One line without its CRLF (or bare LF).
fn read_line<R: BufRead>(r: &mut R) -> io::Result<String> {
    let mut line = Vec::new();
    let n = r
        .by_ref()
        .take(MAX_LINE_BYTES as u64 + 2)
        .read_until(b'\n', &mut line)?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed mid-response",
        ));
    }
    if line.last() != Some(&b'\n') {
        return Err(if n > MAX_LINE_BYTES {
            bad("response line too long")
        } else {
            io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed mid-line")
        });
    }
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| bad("response head is not UTF-8"))
}

fn read_headers<R: BufRead>(r: &mut R) -> io::Result<Vec<(String, String)>> {
    let mut headers = Vec::new();
    loop {
        let line = read_line(r)?;
        if line.is_empty() {
            return Ok(headers);
        }
        if headers.len() >= MAX_HEADERS {
            return Err(bad("too many response headers"));
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| bad(format!("malformed header line {line:?}")))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
}

/// Comma-separated, lower-cased tokens of every `name` header.
fn tokens(headers: &[(String, String)], name: &str) -> Vec<String> {
    headers
        .iter()
        .filter(|(n, _)| n == name)
        .flat_map(|(_, v)| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

/// Reads one response (skipping interim 1xx answers).
pub fn read_response<R: BufRead>(r: &mut R) -> io::Result<Response> {
    loop {
        let status_line = read_line(r)?;
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or("");
        let status: u16 = parts
            .next()
            .and_then(|s| s.parse().ok())
            .filter(|s| (100..1000).contains(s))
            .ok_or_else(|| bad(format!("malformed status line {status_line:?}")))?;
        if !version.starts_with("HTTP/1.") {
            return Err(bad(format!("malformed status line {status_line:?}")));
        }
        let headers = read_headers(r)?;
        if (100..200).contains(&status) {
            continue;
        }
        let connection = tokens(&headers, "connection");
        let mut keep_alive = if version == "HTTP/1.0" {
            connection.iter().any(|t| t == "keep-alive")
        } else {
            !connection.iter().any(|t| t == "close")
        };
        let codings = tokens(&headers, "transfer-encoding");
        let body = if status == 204 || status == 304 {
            Vec::new()
        } else if !codings.is_empty() {
            if codings.last().map(String::as_str) != Some("chunked") {
                return Err(bad(format!("unsupported transfer-encoding {codings:?}")));
            }
            read_chunked(r)?
        } else if let Some(len) = tokens(&headers, "content-length").first() {
            let len: u64 = len
                .parse()
                .map_err(|_| bad(format!("invalid content-length {len:?}")))?;
            if len > MAX_BODY_BYTES {
                return Err(bad(format!("response body of {len} bytes is too large")));
            }
            read_exact(r, len)?
        } else {
            // Delimited by the end of the connection.
            keep_alive = false;
            let mut body = Vec::new();
            r.by_ref().take(MAX_BODY_BYTES).read_to_end(&mut body)?;
            body
        };
        return Ok(Response {
            status,
            headers,
            body,
            keep_alive,
        });
    }
}

fn read_exact<R: BufRead>(r: &mut R, len: u64) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    let got = r.by_ref().take(len).read_to_end(&mut body)?;
    if got as u64 != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "response body truncated",
        ));
    }
    Ok(body)
}

/// Decodes a chunked body (extensions ignored, trailers discarded).
pub fn read_chunked<R: BufRead>(r: &mut R) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line = read_line(r)?;
        let digits = line.split(';').next().unwrap_or("").trim();
        let size = u64::from_str_radix(digits, 16)
            .map_err(|_| bad(format!("invalid chunk size {line:?}")))?;
        if size == 0 {
            read_headers(r)?;
            return Ok(body);
        }
        if body.len() as u64 + size > MAX_BODY_BYTES {
            return Err(bad("response body too large"));
        }
        body.extend_from_slice(&read_exact(r, size)?);
        if !read_line(r)?.is_empty() {
            return Err(bad("missing CRLF after chunk data"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> io::Result<Response> {
        read_response(&mut text.as_bytes())
    }

    #[test]
    fn targets() {
        let t = Target::parse("http://127.0.0.1:10000").expect("plain");
        assert_eq!(t.authority, "127.0.0.1:10000");
        assert_eq!(t.base, "");
        let t = Target::parse("http://localhost:8080/api/").expect("with base");
        assert_eq!(t.base, "/api");
        for bad in [
            "127.0.0.1:1",
            "https://a:1",
            "http://a",
            "http://:1",
            "http://a:0",
            "http://a:x",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn request_bytes() {
        let t = Target::parse("http://h:1/b").expect("target");
        let req = post(&t, "/v1/completions", &[("x-key", "k")], b"{}");
        let text = String::from_utf8(req).expect("ascii");
        assert!(text.starts_with("POST /b/v1/completions HTTP/1.1\r\nhost: h:1\r\n"));
        assert!(text.contains("content-length: 2\r\n"));
        assert!(text.ends_with("x-key: k\r\n\r\n{}"));
        assert!(valid_header_value("t1-s2 x"));
        assert!(!valid_header_value("a\r\nb: c"));
        assert!(!valid_header_value(" a"));
        assert!(valid_header_name("x-smg-routing-key"));
        assert!(!valid_header_name("bad name"));
    }

    #[test]
    fn content_length_and_keep_alive() {
        let r = parse("HTTP/1.1 200 OK\r\nX-DP-Rank: 3\r\nContent-Length: 5\r\n\r\nhelloEXTRA")
            .expect("response");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-dp-rank"), Some("3"));
        assert_eq!(r.body, b"hello");
        assert!(r.keep_alive);
        let r = parse(
            "HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
        )
        .expect("response");
        assert_eq!(r.status, 503);
        assert!(!r.keep_alive);
        let r = parse("HTTP/1.0 200 OK\r\n\r\nuntil close").expect("close-delimited");
        assert_eq!(r.body, b"until close");
        assert!(!r.keep_alive);
    }

    #[test]
    fn chunked_with_interim_and_trailers() {
        let r = parse(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
             4;x=y\r\ndata\r\nA\r\n: {\"a\":1}\n\r\n0\r\nTrailer: t\r\n\r\n",
        )
        .expect("chunked");
        assert_eq!(r.body, b"data: {\"a\":1}\n");
        assert!(r.keep_alive);
    }

    #[test]
    fn malformed_and_truncated() {
        for bad in [
            "",
            "garbage\r\n\r\n",
            "HTTP/1.1 abc OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
            "HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
