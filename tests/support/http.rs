//! A deliberately small HTTP/1.1 client over `std::net::TcpStream`.
//!
//! Enough for the tests: requests with headers and a body, responses framed by
//! content-length, chunked encoding or connection close, keep-alive reuse, and a
//! streaming read that timestamps every chunk (to prove SSE is not buffered).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Long enough for a slow CI machine, short enough that a request the filter
/// wrongly paused (Envoy's idle timeout is minutes) fails the test instead of hanging it.
const IO_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn new(method: &str, path: &str) -> Request {
        Request {
            method: method.to_string(),
            path: path.to_string(),
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    pub fn get(path: &str) -> Request {
        Request::new("GET", path)
    }

    pub fn post(path: &str) -> Request {
        Request::new("POST", path)
    }

    pub fn header(mut self, name: &str, value: &str) -> Request {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// A JSON body with `content-type: application/json`.
    pub fn json(self, value: &Value) -> Request {
        self.body("application/json", value.to_string().into_bytes())
    }

    pub fn body(mut self, content_type: &str, body: Vec<u8>) -> Request {
        self.body = body;
        self.header("content-type", content_type)
    }

    /// The request as a chunked upload (no content-length): the head, then the
    /// body cut at `splits` (ascending offsets) into one HTTP chunk per piece, then
    /// the last chunk. Returned as wire pieces: the head with the first chunk,
    /// each further chunk, and the terminating zero chunk with the last one, so a
    /// caller can flush (and pause) between pieces.
    pub fn chunked_pieces(&self, splits: &[usize], close: bool) -> Vec<Vec<u8>> {
        self.chunked_pieces_with_trailers(splits, close, &[])
    }

    /// [`Request::chunked_pieces`] with `trailers` (name, value) after the last chunk.
    pub fn chunked_pieces_with_trailers(
        &self,
        splits: &[usize],
        close: bool,
        trailers: &[(&str, &str)],
    ) -> Vec<Vec<u8>> {
        let mut head = self.head(close, None);
        head.truncate(head.len() - 2); // reopen the header block
        head.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
        let mut bounds = vec![0];
        bounds.extend(
            splits
                .iter()
                .copied()
                .filter(|&s| s > 0 && s < self.body.len()),
        );
        bounds.push(self.body.len());
        let mut pieces: Vec<Vec<u8>> = bounds
            .windows(2)
            .filter(|w| w[1] > w[0])
            .map(|w| {
                let chunk = &self.body[w[0]..w[1]];
                let mut piece = format!("{:x}\r\n", chunk.len()).into_bytes();
                piece.extend_from_slice(chunk);
                piece.extend_from_slice(b"\r\n");
                piece
            })
            .collect();
        if pieces.is_empty() {
            pieces.push(Vec::new());
        }
        pieces[0].splice(0..0, head);
        let mut end = String::from("0\r\n");
        for (name, value) in trailers {
            end.push_str(&format!("{name}: {value}\r\n"));
        }
        end.push_str("\r\n");
        pieces
            .last_mut()
            .expect("one piece")
            .extend_from_slice(end.as_bytes());
        pieces
    }

    /// The request line and headers (with `content-length: len` when given).
    fn head(&self, close: bool, content_length: Option<usize>) -> Vec<u8> {
        let mut head = format!(
            "{} {} HTTP/1.1\r\nhost: localhost\r\n",
            self.method, self.path
        );
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        if let Some(length) = content_length {
            head.push_str(&format!("content-length: {length}\r\n"));
        }
        if close {
            head.push_str("connection: close\r\n");
        }
        head.push_str("\r\n");
        head.into_bytes()
    }

    /// The bytes on the wire. `close` asks the server to close after the response.
    pub fn encode(&self, close: bool) -> Vec<u8> {
        let length = (!self.body.is_empty() || self.method == "POST").then_some(self.body.len());
        let mut bytes = self.head(close, length);
        bytes.extend_from_slice(&self.body);
        bytes
    }
}

#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    /// Names lower-cased; a repeated header appears once per occurrence.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of a header (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.header_all(name).into_iter().next()
    }

    pub fn header_all(&self, name: &str) -> Vec<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response body is not JSON ({e}); status {} body {:?}",
                self.status,
                self.text()
            )
        })
    }

    /// Whether the server announced it will close the connection.
    fn closes(&self) -> bool {
        self.header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }
}

/// One request on a fresh connection. Fresh connections are spread by the kernel
/// over Envoy's workers, so a sequence of these exercises both of them.
pub fn send(addr: SocketAddr, request: &Request) -> Response {
    let mut reader = connect(addr);
    write_request(reader.get_mut(), request, true);
    read_response(&mut reader, &request.method)
}

/// A keep-alive connection for sending many requests cheaply (all on one worker).
pub struct Client {
    addr: SocketAddr,
    conn: Option<BufReader<TcpStream>>,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        Client { addr, conn: None }
    }

    pub fn send(&mut self, request: &Request) -> Response {
        let addr = self.addr;
        let reader = self.conn.get_or_insert_with(|| connect(addr));
        write_request(reader.get_mut(), request, false);
        let response = read_response(reader, &request.method);
        if response.closes() {
            // Reconnect lazily; never resend, a resend would skew the counters.
            self.conn = None;
        }
        response
    }

    /// Writes `pieces` one after the other on the kept-alive connection, flushing
    /// each and sleeping `gap` between them, then reads one response to `method`.
    pub fn send_pieces(&mut self, pieces: &[Vec<u8>], gap: Duration, method: &str) -> Response {
        let addr = self.addr;
        let reader = self.conn.get_or_insert_with(|| connect(addr));
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 && !gap.is_zero() {
                std::thread::sleep(gap);
            }
            let stream = reader.get_mut();
            stream
                .write_all(piece)
                .and_then(|()| stream.flush())
                .unwrap_or_else(|e| panic!("write piece {i}: {e}"));
        }
        let response = read_response(reader, method);
        if response.closes() {
            self.conn = None;
        }
        response
    }
}

/// What came back for raw bytes sent on a fresh connection, for inputs a proxy
/// may refuse (413, 431, 400): the server may answer and close before it read
/// everything, so a failed write is recorded rather than fatal.
#[derive(Debug)]
pub struct RawOutcome {
    /// The parsed response, if a complete one arrived.
    pub response: Option<Response>,
    /// Everything read until the server closed (or the read timed out / reset).
    pub received: Vec<u8>,
    /// The error that stopped the upload, if the server stopped reading.
    pub write_error: Option<String>,
    /// The error that ended the read, if it did not end with a clean close.
    pub read_error: Option<String>,
}

impl RawOutcome {
    /// The status line (first line of what was received), for reports.
    pub fn status_line(&self) -> String {
        let text = String::from_utf8_lossy(&self.received);
        text.lines().next().unwrap_or("").to_string()
    }
}

/// Sends raw `bytes` (a request the test encoded itself, e.g. with non-UTF-8
/// header values) on a fresh connection and reads until the server closes.
/// `bytes` should ask for `connection: close`. The upload runs on its own
/// thread so a server that answers early and stops reading cannot block it.
pub fn send_raw(addr: SocketAddr, bytes: Vec<u8>, method: &str) -> RawOutcome {
    use std::io::Read;
    let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .expect("read timeout");
    stream
        .set_write_timeout(Some(IO_TIMEOUT))
        .expect("write timeout");
    stream.set_nodelay(true).expect("nodelay");
    let mut writer = stream.try_clone().expect("clone stream");
    let upload = std::thread::spawn(move || {
        writer
            .write_all(&bytes)
            .and_then(|()| writer.flush())
            .err()
            .map(|e| e.to_string())
    });
    let mut reader = stream;
    let mut received = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let read_error = loop {
        match reader.read(&mut buf) {
            Ok(0) => break None,
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) => break Some(e.to_string()),
        }
    };
    // Unblock an upload the server no longer reads.
    let _ = reader.shutdown(std::net::Shutdown::Both);
    let write_error = upload.join().expect("upload thread");
    let response = parse_complete(&received, method);
    RawOutcome {
        response,
        received,
        write_error,
        read_error,
    }
}

/// Parses one response out of `bytes` if they hold a complete one (without
/// panicking on a partial or garbled answer: the caller reports the raw bytes).
fn parse_complete(bytes: &[u8], method: &str) -> Option<Response> {
    let head_end = bytes.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&bytes[..head_end]).ok()?;
    let mut lines = head.split("\r\n");
    let mut parts = lines.next()?.split_whitespace();
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let status: u16 = parts.next()?.parse().ok()?;
    let mut headers = Vec::new();
    for line in lines {
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    let rest = &bytes[head_end + 4..];
    let body = if method == "HEAD" || status == 204 || status == 304 {
        Vec::new()
    } else if is_chunked(&headers) {
        if !rest.ends_with(b"0\r\n\r\n") {
            return None;
        }
        read_chunked_body(&mut BufReader::new(rest))
    } else if let Some((_, length)) = headers.iter().find(|(n, _)| n == "content-length") {
        rest.get(..length.parse::<usize>().ok()?)?.to_vec()
    } else {
        rest.to_vec()
    };
    Some(Response {
        status,
        headers,
        body,
    })
}

/// A response read chunk by chunk, each stamped with its arrival time.
#[derive(Debug)]
pub struct StreamedResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// Time since the request was written, and the chunk's bytes.
    pub chunks: Vec<(Duration, Vec<u8>)>,
}

impl StreamedResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn body(&self) -> Vec<u8> {
        self.chunks.iter().flat_map(|(_, c)| c.clone()).collect()
    }
}

/// Sends `request` and records when each piece of the body arrives. For a chunked
/// response a piece is one HTTP chunk; otherwise one `read()` worth of bytes.
pub fn stream(addr: SocketAddr, request: &Request) -> StreamedResponse {
    let mut reader = connect(addr);
    write_request(reader.get_mut(), request, true);
    let started = Instant::now();
    let (status, headers) = read_head(&mut reader);
    let chunked = is_chunked(&headers);
    let mut chunks = Vec::new();
    loop {
        let piece = if chunked {
            read_chunk(&mut reader)
        } else {
            read_some(&mut reader)
        };
        match piece {
            Some(bytes) => chunks.push((started.elapsed(), bytes)),
            None => break,
        }
    }
    StreamedResponse {
        status,
        headers,
        chunks,
    }
}

fn connect(addr: SocketAddr) -> BufReader<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .expect("read timeout");
    stream
        .set_write_timeout(Some(IO_TIMEOUT))
        .expect("write timeout");
    stream.set_nodelay(true).expect("nodelay");
    BufReader::new(stream)
}

fn write_request(stream: &mut TcpStream, request: &Request, close: bool) {
    stream
        .write_all(&request.encode(close))
        .unwrap_or_else(|e| panic!("write {} {}: {e}", request.method, request.path));
}

/// Reads one complete response, whatever its framing.
pub fn read_response<R: BufRead>(reader: &mut R, method: &str) -> Response {
    let (status, headers) = read_head(reader);
    let body = if method == "HEAD" || status == 204 || status == 304 {
        Vec::new()
    } else if is_chunked(&headers) {
        read_chunked_body(reader)
    } else if let Some(length) = content_length(&headers) {
        read_exact_body(reader, length)
    } else {
        read_to_close(reader)
    };
    Response {
        status,
        headers,
        body,
    }
}

fn read_head<R: BufRead>(reader: &mut R) -> (u16, Vec<(String, String)>) {
    let status_line = read_line(reader);
    let status = parse_status(&status_line);
    let mut headers = Vec::new();
    loop {
        let line = read_line(reader);
        if line.is_empty() {
            return (status, headers);
        }
        let (name, value) = line
            .split_once(':')
            .unwrap_or_else(|| panic!("malformed header line {line:?}"));
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
}

fn parse_status(line: &str) -> u16 {
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next().and_then(|s| s.parse().ok())) {
        (Some(version), Some(status)) if version.starts_with("HTTP/1.") => status,
        _ => panic!("malformed status line {line:?}"),
    }
}

/// One CRLF-terminated line without its terminator; panics on EOF so a connection
/// closed mid-response is reported where it happened.
fn read_line<R: BufRead>(reader: &mut R) -> String {
    let mut line = String::new();
    let n = reader
        .read_line(&mut line)
        .unwrap_or_else(|e| panic!("read response line: {e}"));
    assert!(n > 0, "connection closed before the response was complete");
    line.trim_end_matches(['\r', '\n']).to_string()
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"))
}

fn content_length(headers: &[(String, String)]) -> Option<usize> {
    headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .map(|(_, v)| v.parse().expect("numeric content-length"))
}

fn read_exact_body<R: BufRead>(reader: &mut R, length: usize) -> Vec<u8> {
    let mut body = vec![0; length];
    reader
        .read_exact(&mut body)
        .unwrap_or_else(|e| panic!("read {length}-byte body: {e}"));
    body
}

fn read_to_close<R: BufRead>(reader: &mut R) -> Vec<u8> {
    let mut body = Vec::new();
    reader
        .read_to_end(&mut body)
        .unwrap_or_else(|e| panic!("read body to close: {e}"));
    body
}

fn read_chunked_body<R: BufRead>(reader: &mut R) -> Vec<u8> {
    let mut body = Vec::new();
    while let Some(chunk) = read_chunk(reader) {
        body.extend_from_slice(&chunk);
    }
    body
}

/// One chunk of a chunked body; `None` after the last (zero-size) chunk and trailers.
fn read_chunk<R: BufRead>(reader: &mut R) -> Option<Vec<u8>> {
    let size_line = read_line(reader);
    let size_hex = size_line.split(';').next().unwrap_or("").trim();
    let size = usize::from_str_radix(size_hex, 16)
        .unwrap_or_else(|e| panic!("bad chunk size {size_line:?}: {e}"));
    if size == 0 {
        // Trailers (if any) end with an empty line.
        while !read_line(reader).is_empty() {}
        return None;
    }
    let chunk = read_exact_body(reader, size);
    let crlf = read_line(reader);
    assert!(crlf.is_empty(), "chunk not followed by CRLF: {crlf:?}");
    Some(chunk)
}

fn read_some<R: BufRead>(reader: &mut R) -> Option<Vec<u8>> {
    let buf = reader
        .fill_buf()
        .unwrap_or_else(|e| panic!("read body: {e}"));
    if buf.is_empty() {
        return None;
    }
    let piece = buf.to_vec();
    reader.consume(piece.len());
    Some(piece)
}

/// A request encoded by hand: header values are raw bytes (they need not be
/// UTF-8). Always `connection: close`, framed by content-length.
pub fn raw_request(path: &str, headers: &[(&str, &[u8])], body: &[u8]) -> Vec<u8> {
    raw_request_typed(path, b"application/json", headers, body)
}

/// [`raw_request`] with `content_type` (raw bytes) instead of `application/json`.
pub fn raw_request_typed(
    path: &str,
    content_type: &[u8],
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> Vec<u8> {
    let mut bytes = format!("POST {path} HTTP/1.1\r\nhost: localhost\r\n").into_bytes();
    for (name, value) in headers {
        bytes.extend_from_slice(name.as_bytes());
        bytes.extend_from_slice(b": ");
        bytes.extend_from_slice(value);
        bytes.extend_from_slice(b"\r\n");
    }
    bytes.extend_from_slice(b"content-type: ");
    bytes.extend_from_slice(content_type);
    bytes.extend_from_slice(
        format!(
            "\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    bytes.extend_from_slice(body);
    bytes
}
