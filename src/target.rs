//! Where one engine with internal data parallelism reads the rank, path by path.
//!
//! SGLang (`--dp-size N`) and vLLM (data parallel) run every rank behind one address and let a
//! request name its rank, but not the same way on every path: SGLang honours the header
//! `X-Data-Parallel-Rank` on its OpenAI paths (where it wins over the body field) and ignores it
//! on `/generate`, which reads only the body field `routed_dp_rank` (`data_parallel_rank` being
//! its deprecated alias); vLLM honours `X-data-parallel-rank` on its OpenAI paths and has no body
//! field. An [`EngineTarget`] lists, per path prefix, the header the filter sets and the body
//! fields the engine reads there: the filter sets the header, or, where the engine takes no
//! header, the first body field; a caller who may not choose a rank has its own copies of both
//! removed.

use crate::body_rewrite::RankEdit;

/// The rank header SGLang and vLLM read (names are case-insensitive).
pub const RANK_HEADER: &str = "x-data-parallel-rank";
/// SGLang's header that sets a request's rank over everything else, on every path, when the
/// server runs with `SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES`: the filter never sets it, and
/// removes a client's copies like the rank header's.
pub const SGLANG_OVERRIDE_HEADER: &str = "x-override-routed-dp-rank";
/// SGLang's body field, and its deprecated alias (which `routed_dp_rank` outranks).
pub const SGLANG_BODY_FIELDS: [&str; 2] = ["routed_dp_rank", "data_parallel_rank"];

/// Where the engine reads the rank on the paths under `prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTarget {
    /// A path prefix matched at a segment boundary (`/generate` matches `/generate`,
    /// `/generate/x` and `/generate?x`, not `/generated`); `/` matches every path.
    pub prefix: String,
    /// The header (lower-case) the engine honours here; the filter sets it to the rank. When
    /// the engine also reads body fields here, the header wins over them.
    pub header: Option<String>,
    /// Top-level body fields the engine reads the rank from here. Without a header the filter
    /// sets the first; a caller who may not choose a rank has every one of them removed.
    pub body_fields: Vec<String>,
}

impl PathTarget {
    fn header_only(prefix: &str, header: &str) -> PathTarget {
        PathTarget {
            prefix: prefix.into(),
            header: Some(header.into()),
            body_fields: Vec::new(),
        }
    }

    /// Whether `path` (the request's `:path`, query included) is under this prefix.
    pub fn matches(&self, path: &str) -> bool {
        let Some(rest) = path.strip_prefix(self.prefix.as_str()) else {
            return false;
        };
        self.prefix.ends_with('/') || rest.is_empty() || rest.starts_with(['/', '?'])
    }

    /// The body field the filter sets to the rank: the first, where no header is honoured.
    pub fn rank_field(&self) -> Option<&str> {
        match self.header {
            Some(_) => None,
            None => self.body_fields.first().map(String::as_str),
        }
    }

    /// Whether this request's body may need an edit (see [`PathTarget::body_edit`]) once its
    /// rank is known: the rank goes into the body, or a caller who may not choose a rank could
    /// have put one there.
    pub fn edits_body(&self, may_choose_rank: bool) -> bool {
        self.rank_field().is_some() || (!may_choose_rank && !self.body_fields.is_empty())
    }

    /// The edit a body needs once the rank is known (`None`: the filter sets none): the rank
    /// field set where the engine takes no header, the caller's own rank fields removed unless
    /// it may choose a rank, or unless the filter sets the header, which wins over them.
    /// `None` when the body can go as it is.
    pub fn body_edit(&self, rank: Option<u32>, may_choose_rank: bool) -> Option<RankEdit<'_>> {
        let set = self.rank_field().zip(rank);
        let remove = match (&self.header, rank) {
            (Some(_), Some(_)) => &[],
            _ => self.fields_to_strip(may_choose_rank, set.is_some()),
        };
        (set.is_some() || !remove.is_empty()).then_some(RankEdit { set, remove })
    }

    /// The body fields to remove from a caller who may not choose a rank: all of them, but the
    /// one the filter sets (`rank_set`), which is replaced instead.
    fn fields_to_strip(&self, may_choose_rank: bool, rank_set: bool) -> &[String] {
        match (may_choose_rank, rank_set) {
            (true, _) => &[],
            (false, true) => self.body_fields.get(1..).unwrap_or_default(),
            (false, false) => &self.body_fields,
        }
    }
}

/// The engines with a preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sglang,
    Vllm,
}

impl Engine {
    pub const NAMES: &'static str = "\"sglang\" or \"vllm\"";

    pub fn from_name(name: &str) -> Option<Engine> {
        match name {
            "sglang" => Some(Engine::Sglang),
            "vllm" => Some(Engine::Vllm),
            _ => None,
        }
    }
}

/// One engine's paths, matched in order (the first matching prefix decides).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineTarget {
    pub paths: Vec<PathTarget>,
    /// Every distinct header of `paths`, and any other the engine takes a rank from, for
    /// stripping a client's copies.
    pub headers: Vec<String>,
}

impl EngineTarget {
    pub fn new(paths: Vec<PathTarget>) -> EngineTarget {
        let mut headers: Vec<String> = Vec::new();
        for h in paths.iter().filter_map(|p| p.header.as_ref()) {
            if !headers.contains(h) {
                headers.push(h.clone());
            }
        }
        EngineTarget { paths, headers }
    }

    /// `target.mode: engine_header`: one header on every path.
    pub fn one_header(header: &str) -> EngineTarget {
        EngineTarget::new(vec![PathTarget::header_only("/", header)])
    }

    /// What each engine honours, checked in its source: SGLang's OpenAI paths and its SageMaker
    /// `/invocations` (a chat completion) take the header (and the body fields when there is
    /// none), `/generate` the body field only; vLLM's OpenAI paths take the header only. Other
    /// paths are not listed: they choose no rank.
    pub fn preset(engine: Engine) -> EngineTarget {
        // One loop over a list per engine rather than code per path: cold code, kept small.
        let (sglang, prefixes): (bool, &[&str]) = match engine {
            Engine::Sglang => (
                true,
                &[
                    "/v1/chat/completions",
                    "/v1/completions",
                    "/v1/responses",
                    "/v1/messages",
                    "/invocations",
                    "/generate",
                ],
            ),
            Engine::Vllm => (
                false,
                &[
                    "/v1/chat/completions",
                    "/v1/completions",
                    "/v1/responses",
                    "/v1/messages",
                ],
            ),
        };
        let paths = prefixes
            .iter()
            .map(|&prefix| PathTarget {
                prefix: prefix.into(),
                // SGLang's `/generate` takes no header, only the body fields.
                header: (prefix != "/generate").then(|| RANK_HEADER.into()),
                body_fields: if sglang {
                    SGLANG_BODY_FIELDS.iter().map(|f| f.to_string()).collect()
                } else {
                    Vec::new()
                },
            })
            .collect();
        let mut target = EngineTarget::new(paths);
        if sglang {
            target.headers.push(SGLANG_OVERRIDE_HEADER.into());
        }
        target
    }

    /// The target of `path` (the raw `:path`), `None` when no entry covers it. The path is
    /// percent-decoded first, as the engine's HTTP server decodes it before routing: a
    /// `/gener%61te` reaches `/generate` there, so it must here.
    pub fn for_path(&self, path: &[u8]) -> Option<&PathTarget> {
        self.paths.get(self.index_for(path)?)
    }

    /// [`EngineTarget::for_path`] as an index into `paths`.
    pub fn index_for(&self, path: &[u8]) -> Option<usize> {
        let decoded = percent_decode_path(path);
        self.paths.iter().position(|p| p.matches(&decoded))
    }
}

/// Whether the engine parses a body with this `content-type` as JSON. Their HTTP layer
/// (FastAPI) does for no content type at all and for `application/json` and
/// `application/*+json` (parameters ignored), so a body the filter must edit is read in all of
/// these cases: otherwise a client could send its own rank field past the filter by leaving the
/// content type out.
///
/// The media type is read as FastAPI reads it: the header's bytes as Latin-1, cut at the first
/// `;`, with Python's `str.strip()` whitespace removed from both ends (which includes `\x1c`–`\x1f`,
/// `\x85` and `\xa0`, not only ASCII spaces), compared case-insensitively. Reading it any more
/// strictly would let `application/json\xa0` past the filter unedited while the engine still
/// parses the body, rank field and all. Where the two readings could differ, the filter errs on
/// the side of editing.
pub fn engine_parses_as_json(content_type: Option<&[u8]>) -> bool {
    let Some(ct) = content_type else {
        return true;
    };
    let media = ct.split(|&c| c == b';').next().unwrap_or(ct);
    let media = python_strip(media).to_ascii_lowercase();
    media.is_empty()
        || media == b"application/json"
        || (media.starts_with(b"application/") && media.ends_with(b"+json"))
}

/// `bytes` without the characters Python's `str.strip()` removes from a Latin-1 string.
fn python_strip(bytes: &[u8]) -> &[u8] {
    let space = |c: &u8| matches!(c, b'\t'..=b'\r' | 0x1c..=0x20 | 0x85 | 0xa0);
    let start = bytes.iter().position(|c| !space(c)).unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|c| !space(c))
        .map_or(start, |i| i + 1);
    bytes.get(start..end).unwrap_or_default()
}

/// The path part of `raw` (up to `?`) percent-decoded, then the query as it came; bytes that
/// are not UTF-8 become U+FFFD (no prefix contains one).
fn percent_decode_path(raw: &[u8]) -> String {
    let split = raw.iter().position(|&c| c == b'?').unwrap_or(raw.len());
    let (path, query) = raw.split_at(split);
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&c) = path.get(i) {
        let hex = |at: usize| path.get(at).and_then(|d| (*d as char).to_digit(16));
        match (c, hex(i + 1), hex(i + 2)) {
            (b'%', Some(hi), Some(lo)) => {
                // Two hex digits: below 256.
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    out.extend_from_slice(query);
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_at_segment_boundaries() {
        let p = PathTarget::header_only("/generate", RANK_HEADER);
        for (path, want) in [
            ("/generate", true),
            ("/generate?stream=1", true),
            ("/generate/x", true),
            ("/generated", false),
            ("/Generate", false),
            ("/v1/generate", false),
            ("", false),
        ] {
            assert_eq!(p.matches(path), want, "{path}");
        }
        let all = PathTarget::header_only("/", RANK_HEADER);
        assert!(all.matches("/anything") && all.matches("/"));
    }

    #[test]
    fn presets_say_what_each_engine_honours() {
        let sglang = EngineTarget::preset(Engine::Sglang);
        let chat = sglang.for_path(b"/v1/chat/completions").unwrap();
        assert_eq!(chat.header.as_deref(), Some(RANK_HEADER));
        assert_eq!(
            chat.rank_field(),
            None,
            "the header wins over the body there"
        );
        assert!(!chat.edits_body(true));
        assert!(chat.edits_body(false), "an untrusted body rank must go");
        let generate = sglang.for_path(b"/generate").unwrap();
        assert_eq!(generate.header, None);
        assert_eq!(generate.rank_field(), Some("routed_dp_rank"));
        assert!(generate.edits_body(true));
        assert_eq!(sglang.for_path(b"/v1/embeddings"), None);
        assert_eq!(sglang.headers, [RANK_HEADER, SGLANG_OVERRIDE_HEADER]);
        // The Responses and Messages APIs read the rank as chat does, in both engines, and so
        // does SGLang's SageMaker route (a chat completion).
        for path in [&b"/v1/responses"[..], b"/v1/messages", b"/invocations"] {
            let target = sglang.for_path(path).unwrap();
            assert_eq!(
                (&target.header, &target.body_fields),
                (&chat.header, &chat.body_fields)
            );
        }

        let vllm = EngineTarget::preset(Engine::Vllm);
        let completions = vllm.for_path(b"/v1/completions?x=1").unwrap();
        assert!(completions.body_fields.is_empty());
        assert!(!completions.edits_body(false));
        assert_eq!(vllm.for_path(b"/generate"), None, "vLLM has no /generate");
        for path in [&b"/v1/responses"[..], b"/v1/messages"] {
            let target = vllm.for_path(path).unwrap();
            assert_eq!(target.header.as_deref(), Some(RANK_HEADER));
            assert!(target.body_fields.is_empty());
        }

        let legacy = EngineTarget::one_header("x-r");
        assert_eq!(
            legacy.for_path(b"/generate").unwrap().header.as_deref(),
            Some("x-r")
        );
        assert_eq!(legacy.headers, ["x-r"]);
    }

    #[test]
    fn body_edits_per_path_and_caller() {
        let sglang = EngineTarget::preset(Engine::Sglang);
        let chat = sglang.for_path(b"/v1/chat/completions").unwrap();
        let generate = sglang.for_path(b"/generate").unwrap();
        /// An edit as owned values: (the field and rank set, the fields removed).
        type Shown = (Option<(String, u32)>, Vec<String>);
        fn shown(e: Option<RankEdit<'_>>) -> Option<Shown> {
            e.map(|e| (e.set.map(|(f, r)| (f.to_string(), r)), e.remove.to_vec()))
        }
        let set = |r| Some(("routed_dp_rank".to_string(), r));
        let alias = vec!["data_parallel_rank".to_string()];
        let both: Vec<String> = SGLANG_BODY_FIELDS.iter().map(|f| f.to_string()).collect();
        // (path, rank, may choose, edit)
        let cases = [
            (chat, Some(2), true, None),
            (chat, Some(2), false, None),
            (chat, None, true, None),
            (chat, None, false, Some((None, both.clone()))),
            (generate, Some(2), true, Some((set(2), vec![]))),
            (generate, Some(2), false, Some((set(2), alias))),
            (generate, None, true, None),
            (generate, None, false, Some((None, both))),
        ];
        for (p, rank, may, want) in cases {
            assert_eq!(
                shown(p.body_edit(rank, may)),
                want,
                "{} {rank:?} {may}",
                p.prefix
            );
        }
    }

    #[test]
    fn content_types_the_engine_reads_as_json() {
        for (ct, want) in [
            (None, true),
            (Some(&b"application/json"[..]), true),
            (Some(b" Application/JSON ; charset=utf-8"), true),
            (Some(b"application/vnd.api+json"), true),
            (Some(b""), true),
            (Some(b"text/plain"), false),
            (Some(b"application/x-www-form-urlencoded"), false),
            (Some(b"text/json"), false),
            // Python's whitespace, stripped by the engine's HTTP layer as by the filter.
            (Some(b"application/json\xa0"), true),
            (Some(b"\x85application/json\x1f; charset=utf-8"), true),
            (Some(b"\x0bAPPLICATION/LD+JSON\x0c"), true),
            // Not whitespace to Python either: the engine reads no JSON.
            (Some(b"application/json\x00"), false),
            (Some(b"application/json\xc2\xa0"), false),
        ] {
            assert_eq!(engine_parses_as_json(ct), want, "{ct:?}");
        }
    }

    #[test]
    fn paths_are_matched_as_the_engine_routes_them() {
        let sglang = EngineTarget::preset(Engine::Sglang);
        assert!(sglang.for_path(b"/gener%61te").is_some());
        assert!(sglang.for_path(b"/v1%2Fcompletions").is_some());
        assert!(sglang.for_path(b"/gener%6").is_none());
        assert!(sglang.for_path(b"/x?p=/generate").is_none());
        assert!(sglang.for_path(b"/generate?q=%zz\xff").is_some());
        assert_eq!(percent_decode_path(b"/a%2"), "/a%2");
        assert_eq!(percent_decode_path(b"/%e9%41?%41"), "/\u{fffd}A?%41");
    }
}
