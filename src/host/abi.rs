//! The few proxy-wasm host calls the filter makes, wrapped so that no host answer can panic.
//!
//! The SDK's own wrappers `panic!` on any status they did not expect (for example a header write
//! after the headers were continued returns BadArgument), and a panic aborts the whole wasm VM:
//! every request on that worker would then fail. These wrappers return `Result` for every call,
//! read statuses as plain integers, and parse host-serialised maps without trusting their lengths.

use std::ptr::{null, null_mut};

/// A status code from the host other than Ok.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostError(pub u32);

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
pub const CAS_MISMATCH: u32 = 8;

pub const REQUEST_HEADERS: u32 = 0;
pub const RESPONSE_HEADERS: u32 = 2;
const REQUEST_BODY: u32 = 0;
const COUNTER: u32 = 0;
const GAUGE: u32 = 1;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_pairs(map: u32, data: *mut *mut u8, size: *mut usize) -> u32;
    fn proxy_replace_header_map_value(
        map: u32,
        key: *const u8,
        key_len: usize,
        value: *const u8,
        value_len: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map: u32, key: *const u8, key_len: usize) -> u32;
    fn proxy_get_buffer_bytes(
        buffer: u32,
        start: usize,
        max: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer: u32,
        start: usize,
        size: usize,
        data: *const u8,
        data_len: usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key: *const u8,
        key_len: usize,
        data: *mut *mut u8,
        size: *mut usize,
        cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key: *const u8,
        key_len: usize,
        value: *const u8,
        value_len: usize,
        cas: u32,
    ) -> u32;
    fn proxy_get_property(
        path: *const u8,
        path_len: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_send_local_response(
        status: u32,
        details: *const u8,
        details_len: usize,
        body: *const u8,
        body_len: usize,
        headers: *const u8,
        headers_len: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_define_metric(kind: u32, name: *const u8, name_len: usize, id: *mut u32) -> u32;
    fn proxy_increment_metric(id: u32, offset: i64) -> u32;
    fn proxy_record_metric(id: u32, value: u64) -> u32;
    fn proxy_call_foreign_function(
        name: *const u8,
        name_len: usize,
        args: *const u8,
        args_len: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_get_current_time_nanoseconds(time: *mut u64) -> u32;
    fn proxy_get_log_level(level: *mut u32) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
}

/// Takes ownership of a host-returned buffer. The host allocates it through the SDK's
/// `proxy_on_memory_allocate`, which hands out exact-size boxed slices.
///
/// # Safety
/// `data`/`size` must come from a successful host call that returned a buffer.
unsafe fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        Vec::new()
    } else {
        Vec::from_raw_parts(data, size, size)
    }
}

fn check(status: u32) -> Result<(), HostError> {
    if status == OK {
        Ok(())
    } else {
        Err(HostError(status))
    }
}

/// All headers of a map, serialised as the host sends them. Iterate with [`HeaderMap::pairs`].
pub struct HeaderMap {
    raw: Vec<u8>,
}

impl HeaderMap {
    /// Reads a whole header map in one host call.
    pub fn read(map: u32) -> Result<HeaderMap, HostError> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: out-pointers are valid locals; the buffer is owned by us afterwards.
        let status = unsafe { proxy_get_header_map_pairs(map, &mut data, &mut size) };
        check(status)?;
        Ok(HeaderMap {
            raw: unsafe { take(data, size) },
        })
    }

    /// The `(name, value)` pairs. The layout is `count: u32`, then `count` pairs of
    /// `(name_len: u32, value_len: u32)`, then each name and value followed by a NUL byte.
    /// A malformed buffer yields the pairs that could be read, never a panic.
    pub fn pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let raw = &self.raw[..];
        let count = read_u32(raw, 0).unwrap_or(0) as usize;
        let mut cursor = 4usize.saturating_add(count.saturating_mul(8));
        (0..count).map_while(move |i| {
            let name_len = read_u32(raw, 4 + i * 8)? as usize;
            let value_len = read_u32(raw, 8 + i * 8)? as usize;
            let name = raw.get(cursor..cursor.checked_add(name_len)?)?;
            cursor = cursor.checked_add(name_len + 1)?;
            let value = raw.get(cursor..cursor.checked_add(value_len)?)?;
            cursor = cursor.checked_add(value_len + 1)?;
            Some((name, value))
        })
    }
}

fn read_u32(raw: &[u8], at: usize) -> Option<u32> {
    let b = raw.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(b.try_into().ok()?))
}

/// Sets (replaces) a header.
pub fn set_header(map: u32, name: &str, value: &str) -> Result<(), HostError> {
    // SAFETY: pointers refer to live slices for the duration of the call.
    check(unsafe {
        proxy_replace_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

/// Removes every copy of a header.
pub fn remove_header(map: u32, name: &str) -> Result<(), HostError> {
    // SAFETY: name outlives the call.
    check(unsafe { proxy_remove_header_map_value(map, name.as_ptr(), name.len()) })
}

/// The buffered request body, `start..start+len`.
pub fn request_body(start: usize, len: usize) -> Result<Vec<u8>, HostError> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: out-pointers are valid locals.
    let status = unsafe { proxy_get_buffer_bytes(REQUEST_BODY, start, len, &mut data, &mut size) };
    match status {
        OK => Ok(unsafe { take(data, size) }),
        NOT_FOUND => Ok(Vec::new()),
        s => Err(HostError(s)),
    }
}

/// Replaces the buffered request body's bytes `start..start+len` with `data` (the whole body:
/// `0, body_size`). Only while the request is paused on its body.
pub fn set_request_body(start: usize, len: usize, data: &[u8]) -> Result<(), HostError> {
    // SAFETY: data outlives the call.
    check(unsafe { proxy_set_buffer_bytes(REQUEST_BODY, start, len, data.as_ptr(), data.len()) })
}

/// A shared-data value and its CAS token; `(None, None)` when the key does not exist.
pub fn shared_get(key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
    let (mut data, mut size, mut cas) = (null_mut(), 0usize, 0u32);
    // SAFETY: key outlives the call; out-pointers are valid locals.
    let status =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    match status {
        OK => Ok((Some(unsafe { take(data, size) }), Some(cas))),
        NOT_FOUND => Ok((None, None)),
        s => Err(HostError(s)),
    }
}

/// Writes a shared-data value; `cas` 0 means unconditional (the ABI's convention).
pub fn shared_set(key: &str, value: &[u8], cas: u32) -> Result<(), HostError> {
    let value_ptr = if value.is_empty() {
        null()
    } else {
        value.as_ptr()
    };
    // SAFETY: pointers refer to live slices for the duration of the call.
    check(unsafe { proxy_set_shared_data(key.as_ptr(), key.len(), value_ptr, value.len(), cas) })
}

/// A property such as `upstream.address` (path segments joined by NUL); `Ok(None)` when absent.
pub fn property(path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
    let joined = path.join("\0");
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: joined outlives the call; out-pointers are valid locals.
    let status = unsafe { proxy_get_property(joined.as_ptr(), joined.len(), &mut data, &mut size) };
    match status {
        OK => Ok(Some(unsafe { take(data, size) })),
        NOT_FOUND => Ok(None),
        s => Err(HostError(s)),
    }
}

/// Answers the client directly.
pub fn send_local_response(
    status: u32,
    details: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), HostError> {
    let map = serialize_map(headers);
    // SAFETY: every pointer refers to a live buffer for the duration of the call.
    check(unsafe {
        proxy_send_local_response(
            status,
            details.as_ptr(),
            details.len(),
            body.as_ptr(),
            body.len(),
            map.as_ptr(),
            map.len(),
            -1,
        )
    })
}

fn serialize_map(map: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(map.len() as u32).to_le_bytes());
    for (n, v) in map {
        out.extend_from_slice(&(n.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (n, v) in map {
        out.extend_from_slice(n.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Defines a counter and returns its id.
pub fn define_counter(name: &str) -> Result<u32, HostError> {
    let mut id = 0u32;
    // SAFETY: name outlives the call; id is a valid local.
    check(unsafe { proxy_define_metric(COUNTER, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Adds to a counter. Failures are ignored by callers: a lost increment is not worth a request.
pub fn increment(id: u32, by: i64) -> Result<(), HostError> {
    // SAFETY: plain integer arguments.
    check(unsafe { proxy_increment_metric(id, by) })
}

/// Defines a gauge and returns its id.
pub fn define_gauge(name: &str) -> Result<u32, HostError> {
    let mut id = 0u32;
    // SAFETY: name outlives the call; id is a valid local.
    check(unsafe { proxy_define_metric(GAUGE, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Sets a gauge.
pub fn record(id: u32, value: u64) -> Result<(), HostError> {
    // SAFETY: plain integer arguments.
    check(unsafe { proxy_record_metric(id, value) })
}

/// Asks Envoy to pick the route again (after a header that routes was set from the body callback).
pub fn clear_route_cache() -> Result<(), HostError> {
    let name = "clear_route_cache";
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: name outlives the call; out-pointers are valid locals.
    let status = unsafe {
        proxy_call_foreign_function(name.as_ptr(), name.len(), null(), 0, &mut data, &mut size)
    };
    if status == OK {
        drop(unsafe { take(data, size) });
    }
    check(status)
}

/// Host time in whole unix seconds (what the affinity table stores).
pub fn now_seconds() -> Result<u32, HostError> {
    let mut ns = 0u64;
    // SAFETY: ns is a valid local.
    check(unsafe { proxy_get_current_time_nanoseconds(&mut ns) })?;
    Ok((ns / 1_000_000_000).min(u64::from(u32::MAX)) as u32)
}

/// The host's log level for this plugin (0 trace … 5 critical).
pub fn log_level() -> Result<u32, HostError> {
    let mut level = 0u32;
    // SAFETY: level is a valid local.
    check(unsafe { proxy_get_log_level(&mut level) })?;
    Ok(level)
}

/// Asks for `on_tick` every `ms` milliseconds on this root context.
pub fn set_tick_period_ms(ms: u32) -> Result<(), HostError> {
    // SAFETY: plain integer argument.
    check(unsafe { proxy_set_tick_period_milliseconds(ms) })
}
