//! mock-rank: a stand-in for one data-parallel rank of an LLM server (or, with
//! `--engine --dp-size N`, for one engine with N internal ranks), used by the
//! dp-affinity end-to-end tests and benchmarks behind Envoy.
//!
//! std-only HTTP/1.1, one thread per connection, keep-alive. See
//! /work/notes/interfaces.md for the contract and `--help` for the CLI. The
//! engine model shared with other tools (prompt blocks, prefix cache) is the
//! `mock_rank` library (src/lib.rs).

mod api;
mod cli;
mod engine;
mod http;
mod rank;
mod service;
mod slots;
mod stats;

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use api::Server;
use cli::Command;
use http::{ReadError, Request, ResponseMeta};

/// After deciding to close, how long / how much we keep reading so a client
/// still sending does not get a reset that destroys our final response.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_MAX_BYTES: usize = 1024 * 1024;
const IO_BUFFER_BYTES: usize = 64 * 1024;

fn main() -> ExitCode {
    let cfg = match cli::parse_args(std::env::args().skip(1)) {
        Ok(Command::Run(cfg)) => cfg,
        Ok(Command::Help) => {
            print!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprint!("mock-rank: {msg}\n\n{}", cli::USAGE);
            return ExitCode::from(2);
        }
    };
    let listener = match TcpListener::bind((cfg.host.as_str(), cfg.port)) {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("mock-rank: cannot bind {}:{}: {err}", cfg.host, cfg.port);
            return ExitCode::FAILURE;
        }
    };
    if let Err(err) = announce(&listener) {
        eprintln!("mock-rank: cannot report address: {err}");
        return ExitCode::FAILURE;
    }
    accept_loop(&listener, Arc::new(Server::new(cfg)));
    ExitCode::SUCCESS
}

/// Prints the one readiness line tests wait for. Written with `writeln!` so a
/// closed stdout is an error we report instead of a `println!` panic.
fn announce(listener: &TcpListener) -> io::Result<()> {
    let addr = listener.local_addr()?;
    let mut out = io::stdout().lock();
    writeln!(out, "listening {addr}")?;
    out.flush()
}

fn accept_loop(listener: &TcpListener, srv: Arc<Server>) {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => spawn_connection(stream, Arc::clone(&srv)),
            // Typically EMFILE under load: back off instead of spinning.
            Err(_) => thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn spawn_connection(stream: TcpStream, srv: Arc<Server>) {
    // If no thread can be created the stream is dropped, i.e. the
    // connection is closed, which the client sees as a failed upstream.
    let _ = thread::Builder::new()
        .name("mock-rank-conn".into())
        .spawn(move || serve_connection(stream, &srv));
}

fn serve_connection(stream: TcpStream, srv: &Server) {
    // SSE events are small writes that must leave immediately.
    let _ = stream.set_nodelay(true);
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::with_capacity(IO_BUFFER_BYTES, stream);
    let mut writer = BufWriter::with_capacity(IO_BUFFER_BYTES, write_half);
    loop {
        match serve_one(&mut reader, &mut writer, srv) {
            Ok(true) => continue,
            Ok(false) => break,
            // The peer is gone or the socket broke: nothing left to say.
            Err(_) => return,
        }
    }
    close_gracefully(reader.get_ref());
}

/// Reads and answers one request. Returns whether to keep the connection.
fn serve_one<R: io::BufRead, W: Write>(r: &mut R, w: &mut W, srv: &Server) -> io::Result<bool> {
    let head = match http::read_head(r) {
        Ok(head) => head,
        Err(err) => return reject(w, srv.fixed_rank(), err),
    };
    if head.expect_continue {
        http::write_continue(w)?;
    }
    let body = match http::read_body(r, head.framing) {
        Ok(body) => body,
        Err(err) => return reject(w, srv.fixed_rank(), err),
    };
    api::respond(w, srv, &Request { head, body })
}

/// Turns a read failure into the matching answer; always ends the connection.
/// `rank` is `None` in engine mode: the request never reached an internal rank.
fn reject<W: Write>(w: &mut W, rank: Option<u32>, err: ReadError) -> io::Result<bool> {
    let meta = ResponseMeta::closing(rank);
    match err {
        ReadError::Closed => Ok(false),
        ReadError::Io(err) => Err(err),
        ReadError::Bad(msg) => {
            let body = api::error_json(rank, &msg, "invalid_request_error");
            api::write_json(w, &meta, 400, &body)
        }
        ReadError::TooLarge => {
            let body = api::error_json(rank, "request body too large", "invalid_request_error");
            api::write_json(w, &meta, 413, &body)
        }
    }
}

/// Half-closes and drains for a moment, so the peer reads our last response
/// before it sees the connection end (closing with unread input would send a
/// TCP reset that can discard it).
fn close_gracefully(stream: &TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let _ = stream.set_read_timeout(Some(LINGER));
    let mut sink = [0u8; 8192];
    let mut drained = 0;
    let mut reader = stream;
    while drained < LINGER_MAX_BYTES {
        match reader.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}
