//! Reading the prompt out of a request body: [`Api`] (where a body's prompt is, from the request
//! path), and [`scan_prompt`] / [`prompt_chain`], which walk the body once and stream its
//! canonical prompt into a [`Chain`] of block hashes (`chain`) for the prefix index
//! (`prefix_index`, whose module doc tells how prefix placement fits together).
//!
//! # Canonical prompt
//!
//! A byte stream (or, for token ids, a stream of little-endian `u32`s), built from the body in
//! one pass by API ([`Api`], from the request path):
//! - chat completions: for each element of `messages`, in order: the role, `"`, the content (a
//!   string, or the `text` of every `text`, `input_text` or `output_text` part of an array
//!   content, concatenated, with each media part's sample in its place (`feed_media`); other
//!   parts are ignored), then each of an assistant's `tool_calls` (`walk_tool_call`), `"`.
//!   Other members are ignored; role, content and tool calls are taken in that order whatever
//!   their order in the message object;
//! - completions (`prompt`) and SGLang `/generate` (`text`): a string as is; a list of strings
//!   (a batch) as each string followed by `"`; a list of integers as token ids; a list of lists of
//!   integers as each list followed by the separator id `u32::MAX`. `/generate`'s `input_ids`
//!   is read the same way. Text and token prompts are separate hash domains, and chat is a third
//!   (so a completions batch can never collide with a chat that renders to the same bytes);
//! - OpenAI Responses (`instructions`, `input`): the chat stream of the messages the engines
//!   render from it, `instructions` as a `system` message first (see `SplitPrompt`), in
//!   the chat domain: the same text conversation sent either way shares its entries (media
//!   parts and tool calls are read as each API writes them, so those do not).
//!
//! `"` is an unambiguous separator: it never appears unescaped inside a JSON string.
//!
//! **Strings are hashed as their raw JSON bytes**: escapes are not decoded. Decoding would cost a
//! copy (or a branch per byte) of a prompt that may be megabytes, for no routing gain: a client
//! resends its conversation with the same serialiser, so the same prompt arrives as the same
//! bytes. The price is that two clients escaping the same text differently (`\u00e9` against `é`,
//! as Python's `ensure_ascii` does) do not share entries: a missed sharing, never a wrong answer.
//!
//! The `model` member (anywhere in the object, raw bytes, last one wins) seeds the chain so that
//! models never share entries. It may come after the prompt, so the walk hashes a
//! model-independent chain and mixes the model into each block hash at the end (at most
//! `max_blocks` values). A chat, Responses or Messages body's `tools` (raw JSON, anywhere, last
//! one wins; `null` and `[]` are none) seeds it the same way: the engines render the tool
//! definitions into the prompt near its start, so other tools mean no shared prefix, and a
//! seed costs no blocks. A prompt member present twice: the last one wins, as in serde and
//! Python; inside a message a duplicated `role` or `content` makes the prompt unusable.
//!
//! Only full blocks are hashed (`block_bytes` bytes of text, `block_tokens` ids): a partial last
//! block identifies no cached prefix. Only the first `max_blocks` blocks are hashed; the walk
//! then continues at the scanner's speed only to find `model`, the caller's wanted fields and the
//! end of the body. A body that is not a well-formed JSON object is an error (the caller passes
//! the request through); a well-formed body without a usable prompt (missing, empty, wrong shape,
//! token ids that are not `u32`) gives an empty chain. No recursion: the walker follows only the
//! fixed shapes above and skips everything else with the non-recursive scanner of `json_scan`,
//! so 100,000 nested brackets cost no stack.
//!
//! [`scan_prompt`] also reports wanted top-level members exactly as
//! [`json_scan::scan_top_level`](crate::json_scan::scan_top_level) does, so the body-field
//! extraction and the chain can share one pass over the body.
use crate::chain::{Chain, ChainBuilder, Domain, PrefixHasher};
use crate::config_sections::PrefixConfig;
use crate::json_scan::{ScanError, Scanner, Value};

// ---------------------------------------------------------------------------------------------
// APIs
// ---------------------------------------------------------------------------------------------

/// Which request shape the body has, hence where its prompt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI chat completions: `messages`.
    Chat,
    /// OpenAI completions: `prompt`.
    Completions,
    /// SGLang native `/generate`: `text` or `input_ids`.
    Generate,
    /// OpenAI Responses (`/v1/responses`): `instructions`, then `input`.
    Responses,
    /// Anthropic Messages (`/v1/messages`, which SGLang and vLLM serve): `system`, then
    /// `messages`.
    Messages,
}

impl Api {
    /// The API of a request path (`:path`, query ignored): `.../chat/completions`,
    /// `.../completions`, `.../generate`, `.../responses` (not `.../responses/{id}`, which
    /// carries no prompt) or `.../messages` (not `.../messages/count_tokens`). `None`: no prompt the filter knows how to read.
    pub fn from_path(path: &[u8]) -> Option<Api> {
        let end = path
            .iter()
            .position(|&c| c == b'?' || c == b'#')
            .unwrap_or(path.len());
        let mut p = &path[..end];
        while let [rest @ .., b'/'] = p {
            p = rest;
        }
        if p.ends_with(b"/chat/completions") {
            Some(Api::Chat)
        } else if p.ends_with(b"/completions") {
            Some(Api::Completions)
        } else if p.ends_with(b"/generate") {
            Some(Api::Generate)
        } else if p.ends_with(b"/responses") {
            Some(Api::Responses)
        } else if p.ends_with(b"/messages") {
            Some(Api::Messages)
        } else {
            None
        }
    }

    /// Whether the API takes tool definitions (`tools`), which the engines render into the
    /// prompt.
    fn reads_tools(self) -> bool {
        matches!(self, Api::Chat | Api::Responses | Api::Messages)
    }

    fn is_prompt_field(self, name: &[u8]) -> bool {
        match self {
            Api::Chat => name == b"messages",
            Api::Completions => name == b"prompt",
            Api::Generate => name == b"text" || name == b"input_ids",
            // Those that make the prompt, or tell it is not all in the body (`SplitPrompt`).
            Api::Responses => RESPONSES_MEMBERS.contains(&name),
            Api::Messages => name == b"system" || name == b"messages",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The canonical stream's separators
// ---------------------------------------------------------------------------------------------

/// Separates roles, contents and batch elements in the canonical text stream.
const SEP: u8 = b'"';
/// Separates the lists of a batch of token-id prompts (never a real token id).
const SEP_TOKEN: u32 = u32::MAX;

// ---------------------------------------------------------------------------------------------
// The walk
// ---------------------------------------------------------------------------------------------

/// The chain of `body`'s canonical prompt. `Err` when the body is not a well-formed JSON object.
pub fn prompt_chain(
    body: &[u8],
    api: Api,
    cfg: &PrefixConfig,
    hasher: &PrefixHasher,
) -> Result<Chain, ScanError> {
    scan_prompt(body, api, cfg, hasher, &[], |_, _| {})
}

/// [`prompt_chain`] that also reports the top-level members named in `wanted`, exactly as
/// [`scan_top_level`](crate::json_scan::scan_top_level) would (same values, document order,
/// duplicates each time), in the same single pass over the body.
pub fn scan_prompt<'a>(
    body: &'a [u8],
    api: Api,
    cfg: &PrefixConfig,
    hasher: &PrefixHasher,
    wanted: &[&str],
    mut found: impl FnMut(usize, Value<'a>),
) -> Result<Chain, ScanError> {
    let (mut s, _, empty) = Scanner::open_object(body)?;
    let mut chain = ChainBuilder::new(hasher, cfg);
    let mut model: Option<(usize, usize)> = None;
    let mut tools: Option<(usize, usize)> = None;
    let mut splitting = [None; CACHE_SPLITTING_MEMBERS.len()];
    let mut split = SplitPrompt::default();
    let mut generate = GeneratePrompt::default();
    let mut single = SinglePrompt::default();
    if !empty {
        loop {
            let name = member_name(&mut s)?;
            let start = s.i;
            if name.as_ref() == b"model" {
                model = if s.peek() == Some(b'"') {
                    Some(string_span(&mut s)?)
                } else {
                    s.skip_value()?;
                    None
                };
            } else if name.as_ref() == b"tools" && api.reads_tools() {
                tools = tool_definitions(&mut s)?;
            } else if let Some(k) = CACHE_SPLITTING_MEMBERS.iter().position(|m| *m == &*name) {
                // The last copy counts, as in the engine's Python `dict`.
                splitting[k] = unless_null(&mut s)?;
            } else if api.is_prompt_field(&name) {
                let walkers = (&mut split, &mut generate, &mut single);
                walk_prompt_member(api, &name, &mut s, &mut chain, walkers)?;
            }
            match wanted.iter().position(|w| w.as_bytes() == &*name) {
                Some(idx) if s.i == start => found(idx, s.value()?),
                Some(idx) => {
                    // Already walked for the prompt or the model: read it again for the caller.
                    let mut again = Scanner { b: body, i: start };
                    found(idx, again.value()?);
                }
                None if s.i == start => s.skip_value()?,
                None => {}
            }
            s.skip_ws();
            match s.next_byte()? {
                b',' => {}
                b'}' => break,
                _ => return Err(ScanError::Syntax(s.i - 1)),
            }
        }
    }
    s.expect_end()?;
    match api {
        Api::Responses | Api::Messages => split.finish(api, body, &mut chain)?,
        Api::Generate => generate.finish(body, &mut chain)?,
        Api::Chat | Api::Completions => single.finish(api, body, &mut chain)?,
    }
    let model = model.map(|span| bytes(body, span));
    let tools = tools.map(|span| bytes(body, span));
    let members = splitting.iter().enumerate().fold(0, |key, (k, span)| {
        key ^ span.map_or(0, |span| hasher.member_key(k, bytes(body, span)))
    });
    Ok(chain.finish(model, tools, members))
}

/// Top-level members with which the engine keeps a separate prefix cache for the same prompt:
/// vLLM's and SGLang's `cache_salt` (a tenant's own cache), SGLang's `extra_key` (combined with
/// the salt into its cache key) and `lora_path` (an adapter's KV differs from the base model's).
/// Hashed into every block as sent (raw JSON; `null` as absent), so requests that differ in one
/// never look like sharing a prefix. Other members that change the rendered prompt's start
/// (`reasoning_effort` for some chat templates, `chat_template_kwargs`) are not: most templates
/// ignore them, or change only the prompt's end with them, and a conversation that changes them
/// from one turn to the next would lose its own history.
const CACHE_SPLITTING_MEMBERS: [&[u8]; 3] = [b"cache_salt", b"extra_key", b"lora_path"];

/// The span of the value at the cursor (raw JSON), `None` for `null`.
fn unless_null(s: &mut Scanner<'_>) -> Result<Option<(usize, usize)>, ScanError> {
    let start = s.i;
    s.skip_value()?;
    Ok((bytes(s.b, (start, s.i)) != b"null").then_some((start, s.i)))
}

/// The span of the `tools` value at the cursor (raw JSON, any shape), or `None` for `null` or an
/// empty list: templates render no tools for either (Jinja's `if tools` is false for both).
fn tool_definitions(s: &mut Scanner<'_>) -> Result<Option<(usize, usize)>, ScanError> {
    let Some(span) = unless_null(s)? else {
        return Ok(None);
    };
    let raw = bytes(s.b, span);
    let inner = raw.strip_prefix(b"[").and_then(|r| r.strip_suffix(b"]"));
    let empty = inner.is_some_and(|i| i.iter().all(u8::is_ascii_whitespace));
    Ok((!empty).then_some(span))
}

/// Walks a member that is part of `api`'s prompt (`Api::is_prompt_field`). Not inlined: it is
/// the same code for every caller of the generic [`scan_prompt`].
#[inline(never)]
fn walk_prompt_member(
    api: Api,
    name: &[u8],
    s: &mut Scanner<'_>,
    chain: &mut ChainBuilder<'_>,
    (split, generate, single): (&mut SplitPrompt, &mut GeneratePrompt, &mut SinglePrompt),
) -> Result<(), ScanError> {
    match api {
        Api::Chat | Api::Completions => single.member(api, s, chain),
        Api::Generate => generate.member(name, s, chain),
        Api::Responses | Api::Messages => split.member(api, name, s, chain),
    }
}

/// Chat's `messages`, Completions' `prompt`: one member, walked where it stands. A body that
/// names it again (the last one counts, as in Python) has that last one walked at the end
/// instead of each in turn: walking every copy cost up to `max_blocks` blocks of hashing per
/// copy, however short (an image part stands for 2 KiB of stream in 17 bytes of body).
#[derive(Default)]
struct SinglePrompt {
    walked: bool,
    /// Where the last copy after the first starts.
    last_at: Option<usize>,
}

impl SinglePrompt {
    fn member(
        &mut self,
        api: Api,
        s: &mut Scanner<'_>,
        c: &mut ChainBuilder<'_>,
    ) -> Result<(), ScanError> {
        if std::mem::replace(&mut self.walked, true) {
            self.last_at = Some(s.i);
            return s.skip_value();
        }
        walk_single(api, s, c.restart())
    }

    fn finish(&self, api: Api, body: &[u8], c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
        match self.last_at {
            Some(at) => walk_single(api, &mut Scanner { b: body, i: at }, c.restart()),
            None => Ok(()),
        }
    }
}

fn walk_single(api: Api, s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    if api == Api::Chat {
        walk_messages(s, c)
    } else {
        walk_text_or_ids(s, c)
    }
}

/// `/generate`'s prompt: `text` or `input_ids`, each walked where it stands (the last one present
/// twice wins). A null one is absent (as SGLang reads it), not an empty prompt: clients that dump
/// a whole request object send the other one as null. A null after a value of the same member
/// replaces it, so the chain it gave is dropped and the other member's last value, if any, is
/// walked again at the end.
#[derive(Default)]
struct GeneratePrompt {
    /// The member the chain was walked from: 0 `text`, 1 `input_ids`.
    walked: Option<usize>,
    /// Where each member's last value starts; `None`: absent, or null last.
    at: [Option<usize>; 2],
}

impl GeneratePrompt {
    fn member(
        &mut self,
        name: &[u8],
        s: &mut Scanner<'_>,
        c: &mut ChainBuilder<'_>,
    ) -> Result<(), ScanError> {
        let member = usize::from(name == b"input_ids");
        if s.peek() == Some(b'n') {
            self.at[member] = None;
            return s.skip_value();
        }
        self.at[member] = Some(s.i);
        self.walked = Some(member);
        walk_text_or_ids(s, c.restart())
    }

    fn finish(&self, body: &[u8], c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
        let Some(walked) = self.walked.filter(|&m| self.at[m].is_none()) else {
            return Ok(());
        };
        let c = c.restart();
        match self.at[1 - walked] {
            Some(at) => walk_text_or_ids(&mut Scanner { b: body, i: at }, c),
            None => Ok(()),
        }
    }
}

/// The raw bytes between the quotes of the string at the cursor, as a span of the body.
fn string_span(s: &mut Scanner<'_>) -> Result<(usize, usize), ScanError> {
    let start = s.i + 1;
    s.skip_string()?;
    Ok((start, s.i - 1))
}

fn bytes(b: &[u8], (start, end): (usize, usize)) -> &[u8] {
    b.get(start..end).unwrap_or(&[])
}

/// After an element of an array: `,` (more) or `]` (done).
fn array_next(s: &mut Scanner<'_>) -> Result<bool, ScanError> {
    s.skip_ws();
    match s.next_byte()? {
        b',' => Ok(true),
        b']' => Ok(false),
        _ => Err(ScanError::Syntax(s.i - 1)),
    }
}

/// After a member of an object: `,` (more) or `}` (done).
fn object_next(s: &mut Scanner<'_>) -> Result<bool, ScanError> {
    s.skip_ws();
    match s.next_byte()? {
        b',' => Ok(true),
        b'}' => Ok(false),
        _ => Err(ScanError::Syntax(s.i - 1)),
    }
}

/// Enters an array or object at the cursor (`open`): `false` if it is empty (and consumed).
fn enter(s: &mut Scanner<'_>, open: u8, close: u8) -> Result<bool, ScanError> {
    s.expect(open)?;
    s.skip_ws();
    if s.peek() == Some(close) {
        s.i += 1;
        return Ok(false);
    }
    Ok(true)
}

/// Reads `"name" :` inside an object, leaving the cursor on the value.
fn member_name<'a>(s: &mut Scanner<'a>) -> Result<std::borrow::Cow<'a, [u8]>, ScanError> {
    s.skip_ws();
    let name = s.string()?;
    s.skip_ws();
    s.expect(b':')?;
    s.skip_ws();
    Ok(name)
}

/// `messages`: an array of message objects.
fn walk_messages(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    c.begin(Domain::Chat);
    walk_message_list(s, c)
}

/// The messages of an array, after what the chain has already been fed.
fn walk_message_list(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    if s.peek() != Some(b'[') {
        c.unusable();
        return s.skip_value();
    }
    each_object(s, c, walk_message)
}

/// Walks an array whose elements should be objects, calling `walk` on each; any other element
/// makes the prompt unusable (and is skipped).
fn each_object(
    s: &mut Scanner<'_>,
    c: &mut ChainBuilder<'_>,
    walk: fn(&mut Scanner<'_>, &mut ChainBuilder<'_>) -> Result<(), ScanError>,
) -> Result<(), ScanError> {
    if !enter(s, b'[', b']')? {
        return Ok(());
    }
    loop {
        s.skip_ws();
        if s.peek() == Some(b'{') {
            walk(s, c)?;
        } else {
            c.unusable();
            s.skip_value()?;
        }
        if !array_next(s)? {
            return Ok(());
        }
    }
}

/// One message: role, `"`, text content, then each of its tool calls (`walk_tool_call`), `"`,
/// whatever the member order.
fn walk_message(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    let mut role: Option<(usize, usize)> = None;
    let mut role_fed = false;
    let mut seen_content = false;
    // Start of a content value that came before the role: walked again once the role is fed.
    let mut deferred: Option<usize> = None;
    // Start of the `tool_calls` list: walked after the content, as templates render them.
    let mut tool_calls: Option<usize> = None;
    if enter(s, b'{', b'}')? {
        loop {
            let name = member_name(s)?;
            match &*name {
                b"role" => {
                    if role.is_some() {
                        c.unusable();
                    }
                    let span = if s.peek() == Some(b'"') {
                        string_span(s)?
                    } else {
                        c.unusable();
                        s.skip_value()?;
                        (0, 0)
                    };
                    role = Some(span);
                    if !seen_content {
                        c.feed(bytes(s.b, span));
                        c.feed(&[SEP]);
                        role_fed = true;
                    }
                }
                b"content" => {
                    if seen_content {
                        c.unusable();
                    }
                    seen_content = true;
                    if role_fed {
                        walk_content(s, c)?;
                    } else {
                        deferred = Some(s.i);
                        s.skip_value()?;
                    }
                }
                b"tool_calls" => {
                    tool_calls = (s.peek() == Some(b'[')).then_some(s.i);
                    s.skip_value()?;
                }
                _ => s.skip_value()?,
            }
            if !object_next(s)? {
                break;
            }
        }
    }
    if !role_fed {
        if let Some(span) = role {
            c.feed(bytes(s.b, span));
        }
        c.feed(&[SEP]);
    }
    if let Some(at) = deferred {
        if c.active() {
            walk_content(&mut Scanner { b: s.b, i: at }, c)?;
        }
    }
    if let Some(at) = tool_calls {
        if c.active() {
            each_object(&mut Scanner { b: s.b, i: at }, c, walk_tool_call)?;
        }
    }
    c.feed(&[SEP]);
    if role.is_some_and(|span| bytes(s.b, span) == b"user") {
        c.mark_opening();
    }
    Ok(())
}

/// An assistant message's tool call, `{"id":…,"type":"function","function":{"name":…,
/// "arguments":…}}`: `"`, the function's name, `"`, its arguments (the text of the JSON string
/// OpenAI sends, or any other JSON as sent). The call's id, which clients resend unchanged, is
/// not read; a call without a function adds nothing.
fn walk_tool_call(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    if enter(s, b'{', b'}')? {
        loop {
            let name = member_name(s)?;
            if &*name == b"function" && s.peek() == Some(b'{') {
                let function = read_part(s)?;
                c.feed(&[SEP]);
                c.feed(function.name.unwrap_or_default());
                c.feed(&[SEP]);
                c.feed(function.arguments.unwrap_or_default());
            } else {
                s.skip_value()?;
            }
            if !object_next(s)? {
                break;
            }
        }
    }
    Ok(())
}

/// A message's `content`: a string, an array of parts, or null.
fn walk_content(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    match s.peek() {
        Some(b'"') => {
            let span = string_span(s)?;
            c.feed(bytes(s.b, span));
            Ok(())
        }
        Some(b'[') => walk_parts(s, c),
        Some(b'n') => s.value().map(|_| ()),
        _ => {
            c.unusable();
            s.skip_value()
        }
    }
}

/// A content part whose `text` is prompt text: chat's `text`, the Responses API's
/// `input_text` (a user's) and `output_text` (an answer sent back), which vLLM's chat accepts too.
fn is_text_part(kind: &[u8]) -> bool {
    matches!(kind, b"text" | b"input_text" | b"output_text")
}

/// Content parts that carry media (images, audio, video, files) in chat, Responses and Messages
/// bodies: read by [`feed_media`], not as text.
fn is_media_part(kind: &[u8]) -> bool {
    matches!(
        kind,
        b"image_url"
            | b"input_image"
            | b"image"
            | b"image_embeds"
            | b"image_pil"
            | b"input_audio"
            | b"audio"
            | b"audio_url"
            | b"audio_embeds"
            | b"video_url"
            | b"video"
            | b"file"
            | b"input_file"
            | b"document"
    )
}

/// A media part's member whose value's raw JSON is at most this long is read whole (a URL, a
/// file id).
const MEDIA_WHOLE_BYTES: usize = 512;
/// Otherwise this many bytes are read at each of five places.
const MEDIA_SAMPLE_BYTES: usize = 32;
/// What a media part weighs in the stream at least (zeros after its members make up the rest):
/// about 512 tokens' worth (an image costs an engine hundreds to thousands of tokens), so a
/// first turn made of a short question and a picture fills blocks the index records, and its
/// next turn finds it there instead of asking its home pair again.
const MEDIA_STAND_IN_BYTES: usize = 2048;
static MEDIA_PADDING: [u8; MEDIA_STAND_IN_BYTES] = [0; MEDIA_STAND_IN_BYTES];

/// The bytes that stand for a media part's member in the stream, taken from the value's raw
/// JSON: all of it up to [`MEDIA_WHOLE_BYTES`], else [`MEDIA_SAMPLE_BYTES`] at a fifth, two,
/// three and four fifths of it and at its end (inline base64, where any sample tells two images
/// apart). A client resends a part's payload unchanged, so a conversation keeps its chain, while
/// prompts that differ only by their media (one question about many pictures) no longer share
/// one; and megabytes of base64 are not read as prompt text (blocks stand for tokens, which they
/// are not).
fn media_sample(raw: &[u8]) -> [&[u8]; 6] {
    let n = raw.len();
    if n <= MEDIA_WHOLE_BYTES {
        return [raw, &[], &[], &[], &[], &[]];
    }
    let at = |start: usize| {
        raw.get(start..start + MEDIA_SAMPLE_BYTES)
            .unwrap_or_default()
    };
    [
        &[],
        at(n / 5),
        at(n / 5 * 2),
        at(n / 5 * 3),
        at(n / 5 * 4),
        at(n - MEDIA_SAMPLE_BYTES),
    ]
}

/// Feeds a media part (its `{` at `at`): `"`, its kind, then for each member but `type` and
/// `cache_control`, in the part's order: `"`, its name, `"`, its value's sample (see
/// [`media_sample`]; preceded by the value's length when sampled); then zeros up to
/// [`MEDIA_STAND_IN_BYTES`]. `cache_control` is a marker Anthropic clients move to their newest
/// blocks each turn and the engines ignore: an image that had it in one turn and not in the
/// next is the same prompt.
fn feed_media(c: &mut ChainBuilder<'_>, kind: &[u8], b: &[u8], at: usize) -> Result<(), ScanError> {
    let mut fed = 1 + kind.len();
    c.feed(&[SEP]);
    c.feed(kind);
    let mut p = Scanner { b, i: at };
    if enter(&mut p, b'{', b'}')? {
        loop {
            let name = member_name(&mut p)?;
            let start = p.i;
            p.skip_value()?;
            if !matches!(&*name, b"type" | b"cache_control") {
                let raw = b.get(start..p.i).unwrap_or_default();
                c.feed(&[SEP]);
                c.feed(&name);
                c.feed(&[SEP]);
                fed += 2 + name.len();
                if raw.len() > MEDIA_WHOLE_BYTES {
                    c.feed(&(raw.len() as u64).to_le_bytes());
                    fed += 8;
                }
                for piece in media_sample(raw) {
                    c.feed(piece);
                    fed += piece.len();
                }
            }
            if !object_next(&mut p)? {
                break;
            }
        }
    }
    c.feed(&MEDIA_PADDING[..MEDIA_STAND_IN_BYTES.saturating_sub(fed)]);
    Ok(())
}

/// `[{"type":"text","text":"..."}, {"type":"image_url",...}, ...]`: the text and media parts, in
/// order.
fn walk_parts(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    each_object(s, c, walk_part)
}

/// A part: its `text` if it is a text part, its sample if it is a media part (`feed_media`).
/// Anthropic's blocks add a tool call (`tool_use`): its `name`, `"` and its `input` as raw JSON;
/// and a tool's answer (`tool_result`): the text and media of its `content` (a string, or the
/// parts of a list, read one level deep only). Other parts (thinking blocks, which clients drop
/// from older turns) add nothing.
fn walk_part(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    let start = s.i;
    let part = read_part(s)?;
    if let Some(text) = part.prompt_text() {
        c.feed(text);
        return Ok(());
    }
    match part.kind {
        Some(b"tool_use") => {
            c.feed(part.name.unwrap_or_default());
            c.feed(&[SEP]);
            c.feed(part.input.unwrap_or_default());
        }
        Some(b"tool_result") => match part.content_at {
            Some(at) if s.b.get(at) == Some(&b'[') => {
                each_object(&mut Scanner { b: s.b, i: at }, c, walk_text_part)?;
            }
            Some(at) => walk_content(&mut Scanner { b: s.b, i: at }, c)?,
            None => {}
        },
        Some(kind) if is_media_part(kind) => feed_media(c, kind, s.b, start)?,
        _ => {}
    }
    Ok(())
}

/// A part of a tool result's content: its `text` if it is a text part, its sample if it is a
/// media part (a screenshot), nothing else.
fn walk_text_part(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    let start = s.i;
    let part = read_part(s)?;
    if let Some(text) = part.prompt_text() {
        c.feed(text);
    } else if let Some(kind) = part.kind.filter(|k| is_media_part(k)) {
        feed_media(c, kind, s.b, start)?;
    }
    Ok(())
}

/// What a content part holds, as raw bytes of the body. A member present twice: the last wins;
/// a `type` or `text` that is not a string counts as absent.
#[derive(Default)]
struct Part<'a> {
    kind: Option<&'a [u8]>,
    text: Option<&'a [u8]>,
    name: Option<&'a [u8]>,
    /// The raw JSON of `input` (a tool call's arguments).
    input: Option<&'a [u8]>,
    /// A chat tool call's `arguments`: the text of a string, else the raw JSON.
    arguments: Option<&'a [u8]>,
    /// Where a string or list `content` starts (a tool result's).
    content_at: Option<usize>,
}

impl<'a> Part<'a> {
    /// The `text` of a text part.
    fn prompt_text(&self) -> Option<&'a [u8]> {
        match (self.kind, self.text) {
            (Some(kind), Some(text)) if is_text_part(kind) => Some(text),
            _ => None,
        }
    }
}

fn read_part<'a>(s: &mut Scanner<'a>) -> Result<Part<'a>, ScanError> {
    let mut part = Part::default();
    if enter(s, b'{', b'}')? {
        loop {
            let name = member_name(s)?;
            let at = s.i;
            let kind = s.peek();
            let string = match kind {
                Some(b'"') => Some(bytes(s.b, string_span(s)?)),
                _ => {
                    s.skip_value()?;
                    None
                }
            };
            match &*name {
                b"type" => part.kind = string,
                b"text" => part.text = string,
                b"name" => part.name = string,
                b"input" => part.input = s.b.get(at..s.i),
                b"arguments" => part.arguments = string.or_else(|| s.b.get(at..s.i)),
                b"content" => part.content_at = matches!(kind, Some(b'"' | b'[')).then_some(at),
                _ => {}
            }
            if !object_next(s)? {
                break;
            }
        }
    }
    Ok(part)
}

/// The top-level members `SplitPrompt` reads in a Responses body.
const RESPONSES_MEMBERS: [&[u8]; 4] = [
    b"instructions",
    b"input",
    b"previous_response_id",
    b"conversation",
];

/// A prompt made of two top-level members, gathered during the top-level walk: a *lead* the
/// engines render as a leading system message (Responses `instructions`, Messages `system`: a
/// string, or the text blocks of a list) and a *list* (Responses `input`, Messages `messages`).
/// The canonical stream is the chat one: `system`, `"`, the lead's text, `"`, then the list.
///
/// Responses `input`: a string is one user message; an item is its role (or, for an item without
/// one, its `type`), `"`, its text, `"` — where the text is a function call's `name`, `"` and
/// `arguments`, then the item's `content`, else its `output` (a string, or the `text` /
/// `input_text` / `output_text` and media parts of a list; any other shape, such as a computer
/// call's screenshot object, adds nothing). Ids, status and other members the server adds to the items
/// it returns are ignored, so an item reads the same whether the client sends it back whole or
/// rebuilt. Messages `messages`: as chat's, with Anthropic's content blocks (`walk_part`).
///
/// The first list is walked where it stands. Before any lead (as alphabetical serialisers
/// order both APIs' bodies: `input` before `instructions`, `messages` before `system`) the walk is
/// recorded, not hashed, and replayed after the lead at the end: the chain starts with the lead,
/// and replaying costs the hashing only, not a second walk of the JSON. A later list, or another
/// lead after a list already walked with one, is only located, and the last list is walked again
/// once at the end: at most two walks whatever the number of duplicate members.
///
/// A Responses request continuing server-side state (`previous_response_id` or `conversation`
/// not null, or an `item_reference` item) has no usable prompt: its body holds only the newest
/// items, not the prefix the engine will compute, so reading it would place the turn by a
/// fragment.
#[derive(Default)]
struct SplitPrompt {
    /// Where the last lead value starts, when it has a shape the API takes (a string; for
    /// Messages also a list of blocks).
    lead_at: Option<usize>,
    /// The last lead has another shape, and is not null.
    bad_lead: bool,
    /// Where the last list value starts.
    list_at: Option<usize>,
    /// The first list came before any lead: its walk was recorded, to be replayed after the lead.
    recorded: bool,
    /// The walk of the first list is not the prompt: walk the last one again at the end.
    rewalk: bool,
    /// The last `previous_response_id` and the last `conversation` are not null.
    continues: [bool; 2],
}

impl SplitPrompt {
    /// Reads a member that `Api::is_prompt_field` names.
    fn member(
        &mut self,
        api: Api,
        name: &[u8],
        s: &mut Scanner<'_>,
        c: &mut ChainBuilder<'_>,
    ) -> Result<(), ScanError> {
        match name {
            b"instructions" | b"system" => {
                let at = s.i;
                let kind = s.peek();
                s.skip_value()?;
                // A list of text blocks is Messages' form only; Responses takes a string.
                let read = kind == Some(b'"') || (kind == Some(b'[') && api == Api::Messages);
                self.lead_at = read.then_some(at);
                self.bad_lead = self.lead_at.is_none() && kind != Some(b'n');
                self.rewalk |= self.list_at.is_some() && !self.recorded;
            }
            b"previous_response_id" | b"conversation" => {
                // A value starting with `n` that the scanner accepts is `null`.
                self.continues[usize::from(name == b"conversation")] = s.peek() != Some(b'n');
                s.skip_value()?;
            }
            _ => {
                let first = self.list_at.is_none();
                self.list_at = Some(s.i);
                if first {
                    self.recorded = self.lead_at.is_none() && !self.bad_lead;
                    self.walk(api, s, c, self.recorded)?;
                } else {
                    self.rewalk = true;
                    s.skip_value()?;
                }
            }
        }
        Ok(())
    }

    /// The whole prompt from the list at the cursor: the lead first; with `record`, the walk is
    /// recorded, not hashed, to be replayed after a lead found later (see `finish`).
    fn walk(
        &self,
        api: Api,
        s: &mut Scanner<'_>,
        c: &mut ChainBuilder<'_>,
        record: bool,
    ) -> Result<(), ScanError> {
        let c = c.restart();
        c.begin(Domain::Chat);
        if record {
            c.record(s.b);
        }
        self.feed_lead(s.b, c)?;
        match api {
            Api::Messages => walk_message_list(s, c),
            _ => walk_input(s, c),
        }
    }

    fn feed_lead(&self, body: &[u8], c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
        if let Some(at) = self.lead_at {
            c.feed(b"system\"");
            walk_lead(&mut Scanner { b: body, i: at }, c)?;
            c.feed(&[SEP]);
        }
        Ok(())
    }

    fn finish(&self, api: Api, body: &[u8], c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
        match (c.take_recording(), self.list_at) {
            (Some(recording), _) if !self.rewalk && !recording.overflowed => {
                let c = c.restart();
                c.begin(Domain::Chat);
                self.feed_lead(body, c)?;
                c.replay(body, &recording);
            }
            // A later list, a lead after a list walked with another, or a recording given up.
            (recording, Some(at)) if self.rewalk || recording.is_some() => {
                self.walk(api, &mut Scanner { b: body, i: at }, c, false)?;
            }
            _ => {}
        }
        if self.continues.contains(&true) || self.bad_lead {
            c.unusable();
        }
        Ok(())
    }
}

/// The lead's text: a string, or the text blocks of a list, less Claude Code's per-request
/// billing block, which vLLM drops from the prompt too (it changes every request: reading it
/// would give every request a prompt of its own).
fn walk_lead(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    match s.peek() {
        Some(b'[') => each_object(s, c, walk_system_block),
        _ => walk_content(s, c),
    }
}

/// The first bytes of the system block Claude Code adds to each request.
const BILLING_BLOCK: &[u8] = b"x-anthropic-billing-header";

fn walk_system_block(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    let text = read_part(s)?.prompt_text();
    if let Some(text) = text.filter(|t| !t.starts_with(BILLING_BLOCK)) {
        c.feed(text);
    }
    Ok(())
}

/// `input`: a string (one user message) or an array of items.
fn walk_input(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    match s.peek() {
        Some(b'"') => {
            let span = string_span(s)?;
            c.feed(b"user\"");
            c.feed(bytes(s.b, span));
            c.feed(&[SEP]);
            c.mark_opening();
            Ok(())
        }
        Some(b'[') => each_object(s, c, walk_item),
        _ => {
            c.unusable();
            s.skip_value()
        }
    }
}

/// One `input` item (see `SplitPrompt`): its members are located first, then fed in the
/// canonical order whatever their order in the object.
fn walk_item(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    // The string members read, by their index in ITEM_STRINGS.
    let mut spans: [Option<(usize, usize)>; 4] = [None; 4];
    // Where `content` and `output` start (the text is the content, else the output), when they
    // are a string or a list of parts: other shapes (a computer call's screenshot object) carry
    // no text the chain reads.
    let mut text_at: [Option<usize>; 2] = [None; 2];
    if enter(s, b'{', b'}')? {
        loop {
            let member = member_name(s)?;
            let texty = matches!(s.peek(), Some(b'"' | b'['));
            match ITEM_STRINGS.iter().position(|n| *n == &*member) {
                Some(k) if s.peek() == Some(b'"') => spans[k] = Some(string_span(s)?),
                _ if texty && matches!(&*member, b"content" | b"output") => {
                    text_at[usize::from(&*member == b"output")] = Some(s.i);
                    s.skip_value()?;
                }
                _ => s.skip_value()?,
            }
            if !object_next(s)? {
                break;
            }
        }
    }
    let [role, kind, name, arguments] = spans.map(|span| span.map(|span| bytes(s.b, span)));
    if role.is_none() && kind == Some(b"reasoning") {
        // A model's reasoning, sent back: clients keep it or prune it from one turn to the next
        // while the engine renders the same prompt (earlier turns' reasoning is dropped), so it
        // is not read, like chat's `reasoning_content` and Messages' `thinking`.
        return Ok(());
    }
    if kind == Some(b"item_reference") {
        // Names an item stored on the server: the prompt is not all in the body.
        c.unusable();
    }
    c.feed(role.or(kind).unwrap_or_default());
    c.feed(&[SEP]);
    if let Some(name) = name {
        c.feed(name);
        c.feed(&[SEP]);
    }
    c.feed(arguments.unwrap_or_default());
    if let Some(at) = text_at[0].or(text_at[1]).filter(|_| c.active()) {
        walk_content(&mut Scanner { b: s.b, i: at }, c)?;
    }
    c.feed(&[SEP]);
    if role == Some(b"user") {
        c.mark_opening();
    }
    Ok(())
}

/// The string members of an `input` item that its canonical form reads, in `walk_item`'s order.
const ITEM_STRINGS: [&[u8]; 4] = [b"role", b"type", b"name", b"arguments"];

/// `prompt` / `text` / `input_ids`: a string, a list of strings, ids, or lists of ids.
fn walk_text_or_ids(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    match s.peek() {
        Some(b'"') => {
            c.begin(Domain::Text);
            let span = string_span(s)?;
            c.feed(bytes(s.b, span));
            Ok(())
        }
        Some(b'[') => walk_prompt_list(s, c),
        _ => {
            c.unusable();
            s.skip_value()
        }
    }
}

fn walk_prompt_list(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Kind {
        Strings,
        Ids,
        IdLists,
    }
    if !enter(s, b'[', b']')? {
        return Ok(()); // `[]`: an empty prompt
    }
    // The first element decides what the list is; an element of another kind spoils it.
    let kind = match s.peek() {
        Some(b'"') => Kind::Strings,
        Some(b'[') => Kind::IdLists,
        _ => Kind::Ids,
    };
    c.begin(match kind {
        Kind::Strings => Domain::Text,
        Kind::Ids | Kind::IdLists => Domain::Tokens,
    });
    if kind == Kind::Ids {
        return id_elements(s, c);
    }
    loop {
        s.skip_ws();
        match (kind, s.peek()) {
            (Kind::Strings, Some(b'"')) => {
                let span = string_span(s)?;
                c.feed(bytes(s.b, span));
                c.feed(&[SEP]);
            }
            (Kind::Ids, Some(b'-' | b'0'..=b'9')) => token_id(s, c)?,
            (Kind::IdLists, Some(b'[')) => {
                walk_ids(s, c)?;
                c.push_u32(SEP_TOKEN);
            }
            _ => {
                c.unusable();
                s.skip_value()?;
            }
        }
        if !array_next(s)? {
            return Ok(());
        }
    }
}

/// An inner list of token ids.
fn walk_ids(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    if !enter(s, b'[', b']')? {
        return Ok(());
    }
    id_elements(s, c)
}

/// The elements of a non-empty list of token ids, from the first one to the closing `]`.
fn id_elements(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    loop {
        // Fast path: `digits,` or `digits]`, as serialisers write ids (a few ns an id).
        if let Some(word) = s.b.get(s.i..s.i + 8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            let (len, v) = swar_digits(u64::from_le_bytes(w));
            if len > 0 && !(len > 1 && w[0] == b'0') {
                match w.get(len) {
                    Some(b',') => {
                        s.i += len + 1;
                        c.push_u32(v as u32);
                        continue;
                    }
                    Some(b']') => {
                        s.i += len + 1;
                        c.push_u32(v as u32);
                        return Ok(());
                    }
                    _ => {}
                }
            }
        }
        s.skip_ws();
        if let Some(b'-' | b'0'..=b'9') = s.peek() {
            token_id(s, c)?;
        } else {
            c.unusable();
            s.skip_value()?;
        }
        if !array_next(s)? {
            return Ok(());
        }
    }
}

/// One token id at the cursor (a number). Up to 7 plain digits (every real vocabulary) are
/// parsed eight bytes at a time; anything else (sign, fraction, exponent, more digits) takes the
/// scalar path, and is checked by the scanner and spoils the prompt unless it is a plain `u32`.
#[inline]
fn token_id(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    let start = s.i;
    if let Some(word) = s.b.get(start..start + 8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        let (len, v) = swar_digits(u64::from_le_bytes(w));
        if let Some(&next) = w.get(len) {
            let leading_zero = len > 1 && w[0] == b'0';
            if len > 0 && !leading_zero && !matches!(next, b'.' | b'e' | b'E') {
                s.i += len;
                c.push_u32(v as u32); // < 10^7: always a u32 and never SEP_TOKEN
                return Ok(());
            }
        }
    }
    let mut v: u64 = 0;
    while let Some(&d @ b'0'..=b'9') = s.b.get(s.i) {
        v = v * 10 + u64::from(d - b'0');
        s.i += 1;
        if s.i - start > 10 {
            break;
        }
    }
    let digits = s.i - start;
    let leading_zero = digits > 1 && s.b.get(start) == Some(&b'0');
    let plain = digits > 0
        && digits <= 10
        && !leading_zero
        && !matches!(s.peek(), Some(b'0'..=b'9' | b'.' | b'e' | b'E'));
    match u32::try_from(v) {
        Ok(id) if plain && id != SEP_TOKEN => c.push_u32(id),
        _ => {
            s.i = start;
            s.number()?;
            c.unusable();
        }
    }
    Ok(())
}

/// The leading ASCII digits of eight bytes (little-endian word): how many (0..=8) and, when
/// fewer than 8, their value. No loop and no data-dependent branch (simdjson's eight-digit
/// trick on the digits shifted to the top, the bytes below them reading as leading zeros).
#[inline]
fn swar_digits(w: u64) -> (usize, u64) {
    const LO: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    const HI: u64 = 0xf0f0_f0f0_f0f0_f0f0;
    const SEVENS: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    // A byte is a digit iff its high nibble is 3 and its low nibble at most 9 (no carries
    // between bytes: each sum stays below 0x16).
    let bad = ((w & HI) ^ 0x3030_3030_3030_3030) | (((w & LO) + 0x0606_0606_0606_0606) & HI);
    let nonzero = (((bad & SEVENS) + SEVENS) | bad) & !SEVENS;
    let len = (nonzero.trailing_zeros() / 8) as usize;
    if len == 0 || len == 8 {
        return (len, 0);
    }
    let mut v = (w & LO) << (8 * (8 - len));
    v = v.wrapping_mul(10).wrapping_add(v >> 8);
    v = ((v & 0x0000_00ff_0000_00ff).wrapping_mul(100 + (1_000_000 << 32))
        + ((v >> 16) & 0x0000_00ff_0000_00ff).wrapping_mul(1 + (10_000 << 32)))
        >> 32;
    (len, v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::tests::{cfg, direct, hasher, ids, splitmix};
    use crate::json_scan::scan_top_level;
    use serde_json::{json, Value as Json};

    fn chain(body: &str, api: Api, c: &PrefixConfig) -> Vec<u64> {
        prompt_chain(body.as_bytes(), api, c, &hasher())
            .unwrap_or_else(|e| panic!("{e:?} on {body}"))
            .hashes()
            .to_vec()
    }

    /// The canonical stream computed from a serde DOM (for bodies without escapes, where raw
    /// and decoded strings agree). `None`: no usable prompt.
    fn reference(body: &Json, api: Api) -> Option<(Domain, Vec<u8>)> {
        let text = |v: &Json| v.as_str().map(|s| s.as_bytes().to_vec());
        match api {
            Api::Chat => {
                let mut out = Vec::new();
                for m in body.get("messages")?.as_array()? {
                    let m = m.as_object()?;
                    if let Some(r) = m.get("role") {
                        out.extend(text(r)?);
                    }
                    out.push(SEP);
                    content_reference(m.get("content"), &mut out)?;
                    let calls = m.get("tool_calls").and_then(Json::as_array);
                    for call in calls.into_iter().flatten() {
                        let Some(f) = call.get("function").filter(|f| f.is_object()) else {
                            continue;
                        };
                        out.push(SEP);
                        out.extend(f.get("name").and_then(text).unwrap_or_default());
                        out.push(SEP);
                        match f.get("arguments") {
                            Some(Json::String(a)) => out.extend(a.as_bytes()),
                            Some(other) => out.extend(other.to_string().as_bytes()),
                            None => {}
                        }
                    }
                    out.push(SEP);
                }
                Some((Domain::Chat, out))
            }
            Api::Responses => responses_reference(body),
            // Checked against explicit streams (`messages_canonical_form`): a tool call's input
            // is read as raw JSON, which a DOM does not keep.
            Api::Messages => unreachable!("no DOM reference for Messages bodies"),
            Api::Completions | Api::Generate => {
                let field = match api {
                    Api::Completions => "prompt",
                    _ => ["text", "input_ids"]
                        .into_iter()
                        .find(|f| body.get(f).is_some_and(|v| !v.is_null()))?,
                };
                let id = |v: &Json| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .filter(|&n| n != SEP_TOKEN)
                };
                match body.get(field)? {
                    Json::String(s) => Some((Domain::Text, s.as_bytes().to_vec())),
                    Json::Array(items) if items.is_empty() => None,
                    Json::Array(items) => match &items[0] {
                        Json::String(_) => {
                            let mut out = Vec::new();
                            for i in items {
                                out.extend(text(i)?);
                                out.push(SEP);
                            }
                            Some((Domain::Text, out))
                        }
                        Json::Array(_) => {
                            let mut out = Vec::new();
                            for l in items {
                                for i in l.as_array()? {
                                    out.extend(id(i)?.to_le_bytes());
                                }
                                out.extend(SEP_TOKEN.to_le_bytes());
                            }
                            Some((Domain::Tokens, out))
                        }
                        _ => {
                            let v: Option<Vec<u32>> = items.iter().map(id).collect();
                            Some((Domain::Tokens, ids(&v?)))
                        }
                    },
                    _ => None,
                }
            }
        }
    }

    /// Text of a content value (a string or text parts), as `walk_content` reads it.
    fn content_reference(v: Option<&Json>, out: &mut Vec<u8>) -> Option<()> {
        match v {
            None | Some(Json::Null) => {}
            Some(Json::String(s)) => out.extend(s.as_bytes()),
            Some(Json::Array(parts)) => {
                for part in parts {
                    let p = part.as_object()?;
                    let kind = p.get("type").and_then(Json::as_str).unwrap_or("");
                    if is_text_part(kind.as_bytes()) {
                        if let Some(t) = p.get("text").and_then(Json::as_str) {
                            out.extend(t.as_bytes());
                        }
                    } else if is_media_part(kind.as_bytes()) {
                        // Members in serde's order, values' raw JSON as serde writes them (test
                        // bodies write them so too).
                        let begin = out.len();
                        out.push(SEP);
                        out.extend(kind.as_bytes());
                        for (name, value) in p {
                            if name == "type" || name == "cache_control" {
                                continue;
                            }
                            let raw = value.to_string();
                            out.push(SEP);
                            out.extend(name.as_bytes());
                            out.push(SEP);
                            if raw.len() > MEDIA_WHOLE_BYTES {
                                out.extend((raw.len() as u64).to_le_bytes());
                            }
                            for piece in media_sample(raw.as_bytes()) {
                                out.extend(piece);
                            }
                        }
                        out.resize(out.len().max(begin + MEDIA_STAND_IN_BYTES), 0);
                    }
                }
            }
            Some(_) => return None,
        }
        Some(())
    }

    fn responses_reference(body: &Json) -> Option<(Domain, Vec<u8>)> {
        let stated = |f: &str| body.get(f).is_some_and(|v| !v.is_null());
        if stated("previous_response_id") || stated("conversation") {
            return None;
        }
        let mut out = Vec::new();
        match body.get("instructions") {
            None | Some(Json::Null) => {}
            Some(Json::String(i)) => {
                out.extend(b"system\"");
                out.extend(i.as_bytes());
                out.push(SEP);
            }
            Some(_) => return None,
        }
        match body.get("input")? {
            Json::String(text) => {
                out.extend(b"user\"");
                out.extend(text.as_bytes());
                out.push(SEP);
            }
            Json::Array(items) => {
                for item in items {
                    let item = item.as_object()?;
                    let string = |f: &str| item.get(f).and_then(Json::as_str);
                    if string("role").is_none() && string("type") == Some("reasoning") {
                        continue;
                    }
                    if let Some(label) = string("role").or(string("type")) {
                        out.extend(label.as_bytes());
                    }
                    out.push(SEP);
                    if let Some(name) = string("name") {
                        out.extend(name.as_bytes());
                        out.push(SEP);
                    }
                    if string("type") == Some("item_reference") {
                        return None;
                    }
                    out.extend(string("arguments").unwrap_or("").as_bytes());
                    let texty = |v: &&Json| v.is_string() || v.is_array();
                    let text = item.get("content").filter(texty);
                    content_reference(text.or(item.get("output").filter(texty)), &mut out)?;
                    out.push(SEP);
                }
            }
            _ => return None,
        }
        Some((Domain::Chat, out))
    }

    /// The stream of a media part whose members' raw JSON is read whole (see `feed_media`).
    fn media(kind: &str, members: &[(&str, &str)]) -> Vec<u8> {
        let mut out = vec![SEP];
        out.extend(kind.as_bytes());
        for (name, raw) in members {
            assert!(raw.len() <= MEDIA_WHOLE_BYTES);
            out.push(SEP);
            out.extend(name.as_bytes());
            out.push(SEP);
            out.extend(raw.as_bytes());
        }
        out.resize(MEDIA_STAND_IN_BYTES, 0);
        out
    }

    fn check_against_reference(body: &str, api: Api, c: &PrefixConfig) {
        let v: Json = serde_json::from_str(body).unwrap();
        let model = v.get("model").and_then(Json::as_str);
        let want = match reference(&v, api) {
            Some((domain, stream)) => direct(domain, &stream, model, c),
            None => Vec::new(),
        };
        assert_eq!(chain(body, api, c), want, "{body}");
    }

    #[test]
    fn chat_canonical_form() {
        let c = cfg(16, 4, 64);
        let body = r#"{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant."},
            {"role":"user","content":"Hello there, how are you today?","name":"bob"}],"temperature":0}"#;
        let stream =
            b"system\"You are a helpful assistant.\"user\"Hello there, how are you today?\"";
        assert_eq!(
            chain(body, Api::Chat, &c),
            direct(Domain::Chat, stream, Some("m"), &c)
        );
        assert_eq!(chain(body, Api::Chat, &c).len(), stream.len() / 16);
        check_against_reference(body, Api::Chat, &c);
    }

    #[test]
    fn responses_canonical_form() {
        let c = cfg(16, 4, 64);
        let body = r#"{"model":"m","instructions":"You are terse.","input":[
            {"role":"user","content":"Weather in Lisbon?"},
            {"type":"function_call","id":"fc_1","call_id":"c1","name":"get_weather","arguments":"{\"city\":\"Lisbon\"}","status":"completed"},
            {"call_id":"c1","output":"sunny, 24C","type":"function_call_output"},
            {"id":"msg_1","content":[{"type":"output_text","text":"Sunny, 24C.","annotations":[]}],"role":"assistant","status":"completed","type":"message"},
            {"type":"message","role":"user","content":[{"type":"input_text","text":"And tomorrow?"},{"image_url":"u","type":"input_image"}]}]}"#;
        let stream = [
            &br#"system"You are terse."user"Weather in Lisbon?"function_call"get_weather"{\"city\":\"Lisbon\"}"function_call_output"sunny, 24C"assistant"Sunny, 24C."user"And tomorrow?"#[..],
            &media("input_image", &[("image_url", r#""u""#)]),
            b"\"",
        ]
        .concat();
        let stream = &stream[..];
        assert_eq!(
            chain(body, Api::Responses, &c),
            direct(Domain::Chat, stream, Some("m"), &c)
        );
        // Instructions after the input: the same prompt (the input re-serialised by serde, which
        // writes the image part's members in the order the body has them).
        let v: Json = serde_json::from_str(body).unwrap();
        let late = format!(
            r#"{{"input":{},"model":"m","instructions":"You are terse."}}"#,
            v["input"]
        );
        assert_eq!(
            chain(&late, Api::Responses, &c),
            chain(body, Api::Responses, &c)
        );
        // The same conversation as a chat, and a string input as one user message.
        let chat = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Weather in Lisbon? Tell me now"}]}"#;
        let text = r#"{"model":"m","input":"Weather in Lisbon? Tell me now","instructions":"You are terse."}"#;
        assert_eq!(chain(text, Api::Responses, &c), chain(chat, Api::Chat, &c));
        assert_eq!(
            opening(text, Api::Responses, &c),
            opening(chat, Api::Chat, &c)
        );
        assert!(opening(body, Api::Responses, &c).is_some());
        check_against_reference(text, Api::Responses, &c);
        // Reasoning items sent back, or pruned by the client: the same prompt.
        let with_reasoning = body.replacen(
            r#"{"type":"function_call""#,
            r#"{"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"Look it up."}],"content":[{"type":"reasoning_text","text":"call the tool"}]},{"type":"function_call""#,
            1,
        );
        assert_ne!(with_reasoning, body);
        assert_eq!(
            chain(&with_reasoning, Api::Responses, &c),
            chain(body, Api::Responses, &c)
        );
        let tool_loop = r#"{"model":"m","input":[{"role":"user","content":"Weather in Lisbon?"},
            {"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"Look it up."}]},
            {"type":"function_call","call_id":"c1","name":"get_weather","arguments":"{}"},
            {"type":"function_call_output","call_id":"c1","output":"sunny, 24C"}]}"#;
        check_against_reference(tool_loop, Api::Responses, &c);
    }

    #[test]
    fn responses_continuing_server_state_or_malformed_have_no_prompt() {
        let c = cfg(16, 4, 64);
        let input =
            r#""input":[{"role":"user","content":"a question long enough for two blocks"}]"#;
        let usable = format!(r#"{{{input},"previous_response_id":null,"conversation":null}}"#);
        assert_eq!(chain(&usable, Api::Responses, &c).len(), 2);
        for extra in [
            r#""previous_response_id":"resp_1""#,
            r#""conversation":"conv_1""#,
            r#""conversation":{"id":"conv_1"}"#,
            r#""instructions":7"#,
            r#""instructions":["x"]"#,
            r#""instructions":[{"role":"developer","content":"be terse"}]"#,
            r#""instructions":[]"#,
        ] {
            for body in [
                format!("{{{input},{extra}}}"),
                format!("{{{extra},{input}}}"),
            ] {
                assert_eq!(
                    chain(&body, Api::Responses, &c),
                    Vec::<u64>::new(),
                    "{body}"
                );
                check_against_reference(&body, Api::Responses, &c);
            }
        }
        for body in [
            r#"{"input":7}"#,
            r#"{"input":{"role":"user"}}"#,
            r#"{"input":["a string item, not an object"]}"#,
            r#"{"instructions":"only instructions, no input at all"}"#,
            r#"{"messages":[{"role":"user","content":"a chat body on the responses path"}]}"#,
        ] {
            assert_eq!(chain(body, Api::Responses, &c), Vec::<u64>::new(), "{body}");
        }
        // The last of each member wins; an item naming a stored item has no prompt either.
        let last_null =
            format!(r#"{{"previous_response_id":"r",{input},"previous_response_id":null}}"#);
        assert_eq!(chain(&last_null, Api::Responses, &c).len(), 2);
        let referenced = r#"{"input":[{"role":"user","content":"a question long enough for two blocks"},{"type":"item_reference","id":"msg_1"}]}"#;
        assert_eq!(chain(referenced, Api::Responses, &c), Vec::<u64>::new());
        // A screenshot object as the output adds nothing; the content, if any, is the text.
        let screenshot = r#"{"input":[{"role":"user","content":"a question long enough for two blocks"},
            {"type":"computer_call_output","call_id":"c","output":{"type":"computer_screenshot","image_url":"u"}},
            {"type":"x","output":"not read","content":"read"}]}"#;
        check_against_reference(screenshot, Api::Responses, &c);
        // 72 bytes of canonical stream.
        assert_eq!(chain(screenshot, Api::Responses, &c).len(), 4);
        // The last `input` wins, with the instructions wherever they are.
        let twice = r#"{"input":"first input, long enough","instructions":"sys","input":"second input, long enough"}"#;
        let once = r#"{"instructions":"sys","input":"second input, long enough"}"#;
        assert_eq!(
            chain(twice, Api::Responses, &c),
            chain(once, Api::Responses, &c)
        );
        assert!(prompt_chain(
            br#"{"input":[{"role":"user","content":"x"}"#,
            Api::Responses,
            &c,
            &hasher()
        )
        .is_err());
    }

    #[test]
    fn messages_canonical_form() {
        let c = cfg(16, 4, 64);
        let body = |billing: &str, system_last: bool| {
            let system = format!(
                r#""system":[{{"type":"text","text":"x-anthropic-billing-header: cc_version=1; {billing}"}},{{"type":"text","text":"You are terse.","cache_control":{{"type":"ephemeral"}}}}]"#
            );
            let messages = r#""messages":[{"role":"user","content":"Fix the test"},
                {"role":"assistant","content":[{"type":"text","text":"Running it."},{"type":"tool_use","id":"toolu_1","name":"bash","input":{"cmd":"make test"}}]},
                {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"1 failed"}]},
                {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},{"type":"text","text":"Fixed."}]},
                {"content":[{"type":"tool_result","tool_use_id":"toolu_2","content":[{"type":"text","text":"ok"},{"type":"image","source":{}}]},{"type":"text","text":"Thanks"}],"role":"user"}]"#;
            match system_last {
                false => format!(r#"{{"model":"m",{system},{messages},"max_tokens":8}}"#),
                true => format!(r#"{{"model":"m",{messages},"max_tokens":8,{system}}}"#),
            }
        };
        let stream = [
            &br#"system"You are terse."user"Fix the test"assistant"Running it.bash"{"cmd":"make test"}"user"1 failed"assistant"Fixed."user"ok"#[..],
            &media("image", &[("source", "{}")]),
            b"Thanks\"",
        ]
        .concat();
        let want = direct(Domain::Chat, &stream, Some("m"), &c);
        assert_eq!(chain(&body("a1", false), Api::Messages, &c), want);
        // Claude Code's billing block changes every request and is not read; the system may
        // come after the messages.
        assert_eq!(chain(&body("b2", true), Api::Messages, &c), want);
        // A plain conversation reads as the same chat.
        let messages = r#"{"model":"m","system":"You are terse.","messages":[{"role":"user","content":"Fix the test, please, now"}]}"#;
        let chat = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Fix the test, please, now"}]}"#;
        assert_eq!(
            chain(messages, Api::Messages, &c),
            chain(chat, Api::Chat, &c)
        );
        assert_eq!(
            opening(messages, Api::Messages, &c),
            opening(chat, Api::Chat, &c)
        );
        assert!(opening(&body("a1", false), Api::Messages, &c).is_some());
        // A tool result's content is read one level deep: a result nested in it adds nothing.
        let nested = r#"{"messages":[{"role":"user","content":[{"type":"tool_result","content":[{"type":"tool_result","content":"deep"},{"type":"text","text":"0123456789abcdef"}]}]}]}"#;
        assert_eq!(
            chain(nested, Api::Messages, &c),
            direct(Domain::Chat, b"user\"0123456789abcdef\"", None, &c)
        );
        for bad in [
            r#"{"system":7,"messages":[{"role":"user","content":"a message long enough for two blocks"}]}"#,
            r#"{"system":"s","messages":{"role":"user"}}"#,
            r#"{"system":"a system prompt long enough for two blocks"}"#,
        ] {
            assert_eq!(chain(bad, Api::Messages, &c), Vec::<u64>::new(), "{bad}");
        }
        let null_system = r#"{"system":null,"messages":[{"role":"user","content":"a message long enough for two blocks"}]}"#;
        assert_eq!(chain(null_system, Api::Messages, &c).len(), 2);
    }

    /// Duplicate `input` and `instructions` members cost at most two walks of the prompt, not one
    /// per member (each walk feeds the instructions again: 256 KiB a member, for 10 bytes of body).
    #[test]
    fn duplicate_responses_members_are_walked_at_most_twice() {
        let c = cfg(512, 16, 512);
        let instructions = "x".repeat(64 * 1024);
        let mut body = format!(r#"{{"instructions":"{instructions}","input":"first""#);
        for _ in 0..200 {
            body.push_str(r#","input":0"#);
        }
        body.push_str(r#","instructions":"short","input":"last","instructions":"#);
        body.push_str(&format!(r#""{instructions}"}}"#));
        crate::chain::tests::FED.with(|f| f.set(0));
        let got = chain(&body, Api::Responses, &c);
        let fed = crate::chain::tests::FED.with(|f| f.get());
        let once = format!(r#"{{"instructions":"{instructions}","input":"last"}}"#);
        assert_eq!(got, chain(&once, Api::Responses, &c));
        assert!(fed <= 2 * (instructions.len() + 64), "fed {fed} bytes");
        // The same for Messages' `system` and `messages`.
        let list = r#""messages":[{"role":"user","content":"hi"}]"#;
        let mut body = format!(r#"{{"system":"{instructions}",{list}"#);
        for _ in 0..200 {
            body.push_str(&format!(",{list}"));
        }
        body.push_str(&format!(r#","system":"{instructions}"}}"#));
        crate::chain::tests::FED.with(|f| f.set(0));
        let got = chain(&body, Api::Messages, &c);
        let fed = crate::chain::tests::FED.with(|f| f.get());
        let once = format!(r#"{{"system":"{instructions}",{list}}}"#);
        assert_eq!(got, chain(&once, Api::Messages, &c));
        assert!(fed <= 2 * (instructions.len() + 64), "fed {fed} bytes");
    }

    /// A body naming `messages` (or `prompt`) again and again is hashed for the last copy alone
    /// (and the first, walked where it stands), not for each: 200 copies of 128 image parts fed
    /// 52 MB to the hash for a 443 KB body.
    #[test]
    fn duplicate_chat_messages_cost_two_walks() {
        let c = cfg(512, 16, 512);
        let parts = vec![r#"{"type":"image"}"#; 128].join(",");
        let member = format!(r#""messages":[{{"role":"user","content":[{parts}]}}]"#);
        let body = format!("{{{}}}", vec![member.as_str(); 200].join(","));
        crate::chain::tests::FED.with(|f| f.set(0));
        let got = chain(&body, Api::Chat, &c);
        let fed = crate::chain::tests::FED.with(|f| f.get());
        assert_eq!(got, chain(&format!("{{{member}}}"), Api::Chat, &c));
        assert!(fed <= 2 * 512 * 512 + 1024, "fed {fed} bytes");
        // The last copy counts, whatever the first held; the same for a completion's prompt.
        let two = r#"{"messages":[{"role":"user","content":"first copy, long enough"}],"model":"m","messages":[{"role":"user","content":"the last copy"}]}"#;
        let last = r#"{"model":"m","messages":[{"role":"user","content":"the last copy"}]}"#;
        assert_eq!(chain(two, Api::Chat, &c), chain(last, Api::Chat, &c));
        let two = r#"{"prompt":"first copy of the prompt","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#;
        let last = r#"{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#;
        assert_eq!(
            chain(two, Api::Completions, &c),
            chain(last, Api::Completions, &c)
        );
        assert!(!chain(last, Api::Completions, &c).is_empty());
    }

    /// A list too fragmented to record (its walk is given up and done again after the lead)
    /// gives the chain of the lead-first body all the same.
    #[test]
    fn a_list_too_fragmented_to_record_is_walked_again() {
        let c = cfg(16, 4, 100_000);
        let items = vec![r#"{"role":"user","content":"a"}"#; 5000].join(",");
        let late = format!(r#"{{"input":[{items}],"instructions":"be brief"}}"#);
        let early = format!(r#"{{"instructions":"be brief","input":[{items}]}}"#);
        let want = chain(&early, Api::Responses, &c);
        assert!(want.len() > 1000, "{}", want.len());
        assert_eq!(chain(&late, Api::Responses, &c), want);
    }

    #[test]
    fn random_responses_bodies_match_the_reference() {
        let mut r = Rng(41);
        for _ in 0..1500 {
            let block = [1, 3, 8, 16, 40][r.below(5) as usize];
            let c = cfg(block, 2, 1 + r.below(30) as u32);
            let mut items = Vec::new();
            for _ in 0..r.below(6) {
                let mut members = match r.below(4) {
                    0 => vec![
                        ("role", json!(r.text(1)).to_string()),
                        ("content", json!(r.text(4)).to_string()),
                    ],
                    1 => vec![
                        ("type", json!("message").to_string()),
                        ("role", json!("assistant").to_string()),
                        ("id", json!("msg_x").to_string()),
                        (
                            "content",
                            json!([{"type":"output_text","text":r.text(3)},{"type":"refusal","refusal":"no"}])
                                .to_string(),
                        ),
                    ],
                    2 => vec![
                        ("type", json!("function_call").to_string()),
                        ("call_id", json!("c").to_string()),
                        ("name", json!(r.text(1)).to_string()),
                        ("arguments", json!(r.text(2)).to_string()),
                    ],
                    _ => vec![
                        ("type", json!("function_call_output").to_string()),
                        ("output", json!(r.text(3)).to_string()),
                    ],
                };
                if r.below(2) == 0 {
                    members.reverse();
                }
                items.push(object(&members));
            }
            let mut top = vec![
                ("input", format!("[{}]", items.join(","))),
                ("temperature", "0.5".to_string()),
            ];
            match r.below(3) {
                0 => top.insert(0, ("instructions", json!(r.text(3)).to_string())),
                1 => top.push(("instructions", json!(r.text(3)).to_string())),
                _ => {}
            }
            if r.below(4) != 0 {
                let at = r.below(3) as usize;
                top.insert(at, ("model", json!(r.text(2)).to_string()));
            }
            check_against_reference(&object(&top), Api::Responses, &c);
        }
    }

    fn opening(body: &str, api: Api, c: &PrefixConfig) -> Option<crate::chain::Opening> {
        prompt_chain(body.as_bytes(), api, c, &hasher())
            .unwrap_or_else(|e| panic!("{e:?} on {body}"))
            .opening()
    }

    /// Whether the prompt goes on past its opening: a later turn of a chat does, a first turn or
    /// a conversation folded into one message does not, whatever the members' order.
    #[test]
    fn a_prompt_says_whether_it_goes_on_past_its_opening() {
        let c = cfg(16, 4, 64);
        let past = |body: &str, api| {
            let chain = prompt_chain(body.as_bytes(), api, &c, &hasher())
                .unwrap_or_else(|e| panic!("{e:?} on {body}"));
            (chain.opening().is_some(), chain.past_opening())
        };
        let first = r#"{"model":"m","messages":[{"role":"system","content":"Be terse."},
            {"role":"user","content":"Plan a trip to Lisbon, please"}]}"#;
        let second = r#"{"model":"m","messages":[{"role":"user","content":"Plan a trip"},
            {"role":"assistant","content":"Day 1: Alfama."},{"role":"user","content":"Day 2?"}]}"#;
        let folded = r#"{"model":"m","messages":[{"role":"user","content":"User: Plan a trip\nAssistant: Day 1\nUser: Day 2?"}]}"#;
        // Exactly a block's worth after the opening still counts (the block is hashed).
        let a_block_more = r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"0123456789"}]}"#;
        assert_eq!(past(first, Api::Chat), (true, false));
        assert_eq!(past(second, Api::Chat), (true, true));
        assert_eq!(past(folded, Api::Chat), (true, false));
        assert_eq!(past(a_block_more, Api::Chat), (true, true));
        assert_eq!(
            past(r#"{"model":"m","prompt":"Plan a trip"}"#, Api::Completions),
            (false, false)
        );
        let responses = r#"{"input":"Plan a trip","instructions":"Be terse.","model":"m"}"#;
        assert_eq!(past(responses, Api::Responses), (true, false));
        let items = r#"{"input":[{"role":"user","content":"Plan a trip"},
            {"type":"function_call","name":"map","arguments":"{}","call_id":"c1"}],"model":"m"}"#;
        assert_eq!(past(items, Api::Responses), (true, true));
        // The Anthropic SDK writes `system` after `messages`: the list is replayed after it.
        let messages = r#"{"messages":[{"role":"user","content":"Plan a trip"}],"model":"m","system":"Be terse."}"#;
        assert_eq!(past(messages, Api::Messages), (true, false));
        let later = r#"{"messages":[{"role":"user","content":"Plan a trip"},
            {"role":"assistant","content":[{"type":"text","text":"Day 1"}]}],"model":"m","system":"Be terse."}"#;
        assert_eq!(past(later, Api::Messages), (true, true));
    }

    #[test]
    fn a_chats_opening_is_the_same_on_every_turn_and_names_the_conversation() {
        let c = cfg(16, 4, 64);
        let turn1 = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},
            {"role":"user","content":"Plan a trip to Lisbon, please"}]}"#;
        let turn2 = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},
            {"role":"user","content":"Plan a trip to Lisbon, please"},{"role":"assistant","content":"Day 1: Alfama."},
            {"role":"user","content":"And day 2?"}]}"#;
        let reordered = r#"{"messages":[{"content":"You are terse.","role":"system"},
            {"content":"Plan a trip to Lisbon, please","role":"user"}],"model":"m"}"#;
        let other = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},
            {"role":"user","content":"Plan a trip to Lisbon, pleaze"}]}"#;
        let other_model = turn1.replace(r#""model":"m""#, r#""model":"n""#);
        let first = opening(turn1, Api::Chat, &c).expect("a chat with a user message has one");
        // The stream through the first user message: 22 + 35 bytes = 3 full blocks and 9 bytes.
        assert_eq!(first.blocks, 3);
        assert_eq!(opening(turn2, Api::Chat, &c), Some(first));
        assert_eq!(opening(reordered, Api::Chat, &c), Some(first));
        // One byte of the user message, or the model, changes it; the chain's blocks did not
        // see that byte yet (it is in the partial fourth block).
        assert_ne!(
            opening(other, Api::Chat, &c).map(|o| o.hash),
            Some(first.hash)
        );
        assert_eq!(chain(other, Api::Chat, &c), chain(turn1, Api::Chat, &c));
        assert_ne!(
            opening(&other_model, Api::Chat, &c).map(|o| o.hash),
            Some(first.hash)
        );
        // An opening never equals a block hash over the same bytes.
        let aligned = r#"{"messages":[{"role":"user","content":"0123456789"}]}"#; // 16 bytes
        let o = opening(aligned, Api::Chat, &c).expect("opening");
        assert_eq!((o.blocks, chain(aligned, Api::Chat, &c).len()), (1, 1));
        assert_ne!(Some(o.hash), chain(aligned, Api::Chat, &c).first().copied());
    }

    #[test]
    fn no_opening_without_a_user_message_within_the_chain() {
        let c = cfg(16, 4, 2);
        let system_only = r#"{"messages":[{"role":"system","content":"You are terse and kind."}]}"#;
        assert_eq!(opening(system_only, Api::Chat, &c), None);
        // The user message ends past max_blocks (2 blocks of 16 bytes).
        let late = r#"{"messages":[{"role":"system","content":"a long system prompt, longer than two blocks"},
            {"role":"user","content":"hi"}]}"#;
        assert_eq!(opening(late, Api::Chat, &c), None);
        let text = r#"{"prompt":"user\"Plan a trip to Lisbon\""}"#;
        assert_eq!(opening(text, Api::Completions, &c), None);
        // A later copy of the prompt member replaces the first, opening included.
        let twice = r#"{"messages":[{"role":"user","content":"first"}],"messages":[{"role":"system","content":"s"}]}"#;
        assert_eq!(opening(twice, Api::Chat, &c), None);
    }

    #[test]
    fn chat_multi_part_content_and_member_order() {
        let c = cfg(16, 4, 64);
        let plain = r#"{"model":"m","messages":[{"role":"user","content":"describe this picture please, in detail"}]}"#;
        let parts = r#"{"model":"m","messages":[{"role":"user","content":[
            {"type":"text","text":"describe this picture "},
            {"type":"text","text":"please, in detail","type":"text"}]}]}"#;
        let reordered = r#"{"messages":[{"content":"describe this picture please, in detail","role":"user"}],"model":"m"}"#;
        let want = chain(plain, Api::Chat, &c);
        assert_eq!(want.len(), 2); // 45 bytes of canonical stream
        assert_eq!(chain(parts, Api::Chat, &c), want);
        assert_eq!(chain(reordered, Api::Chat, &c), want);
        for body in [plain, parts, reordered] {
            check_against_reference(body, Api::Chat, &c);
        }
        // A media part is its kind and its raw JSON (a `text` member in it is not prompt text).
        let image = |url: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":[
                {{"type":"text","text":"describe this picture "}},
                {{"type":"image_url","image_url":{{"url":"{url}"}},"text":"not me"}},
                {{"text":"please, in detail","type":"text"}}]}}]}}"#
            )
        };
        let png = image("data:image/png;base64,AAAA");
        assert_eq!(
            chain(&png, Api::Chat, &c),
            direct(
                Domain::Chat,
                &[
                    &br#"user"describe this picture "#[..],
                    &media(
                        "image_url",
                        &[
                            ("image_url", r#"{"url":"data:image/png;base64,AAAA"}"#),
                            ("text", r#""not me""#),
                        ]
                    ),
                    b"please, in detail\"",
                ]
                .concat(),
                Some("m"),
                &c
            )
        );
        // The same question about another picture is another prompt, past the question's start.
        let other = chain(&image("data:image/png;base64,BBBB"), Api::Chat, &c);
        assert_ne!(other, chain(&png, Api::Chat, &c));
        assert_eq!(other[0], chain(&png, Api::Chat, &c)[0]);
        // Inline base64 is sampled, not read: its length and five pieces of 32 bytes, in a
        // part that weighs its stand-in's 2 KiB (4 KiB of base64 read whole would be more).
        let big = |fill: u8, at: usize| {
            let mut b = vec![b'A'; 4000];
            b[at] = fill;
            image(&format!(
                "data:image/png;base64,{}",
                String::from_utf8(b).unwrap()
            ))
        };
        let c = cfg(64, 4, 512);
        let sampled = chain(&big(b'A', 0), Api::Chat, &c);
        let stand_in =
            br#"user"describe this picture please, in detail""#.len() + MEDIA_STAND_IN_BYTES;
        assert_eq!(sampled.len(), stand_in / 64);
        assert_eq!(
            chain(&big(b'B', 5), Api::Chat, &c),
            sampled,
            "outside the samples"
        );
        // Where the base64 starts in the raw JSON of the part's `image_url`, and how long that is.
        let lead = r#"{"url":"data:image/png;base64,"#.len();
        let n = lead + 4000 + r#""}"#.len();
        for k in 1..=4 {
            let at = n / 5 * k - lead + MEDIA_SAMPLE_BYTES / 2;
            assert_ne!(
                chain(&big(b'B', at), Api::Chat, &c),
                sampled,
                "sampled at {k}/5"
            );
        }
        assert_ne!(
            chain(&big(b'B', 3999), Api::Chat, &c),
            sampled,
            "sampled at the end"
        );
        // Content-first with multi-part content, and a null content (an assistant tool call).
        let mixed = r#"{"messages":[{"content":[{"type":"text","text":"abcdefghijklmnopqrstuvwxyz"}],"role":"user"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"x"}]},{"role":"tool","content":"42"}]}"#;
        check_against_reference(mixed, Api::Chat, &c);
        assert_eq!(
            chain(mixed, Api::Chat, &c),
            direct(
                Domain::Chat,
                b"user\"abcdefghijklmnopqrstuvwxyz\"assistant\"\"tool\"42\"",
                None,
                &c
            )
        );
    }

    /// Every media part the engines accept is read: audio by URL (SGLang's and vLLM's usual
    /// form), precomputed embeddings. Read as nothing, two transcriptions of different files
    /// behind one instruction would be one prompt, and every one would follow the first.
    #[test]
    fn audio_and_embedding_parts_are_media() {
        let c = cfg(16, 4, 64);
        let ask = |part: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"You transcribe audio files faithfully."}},{{"role":"user","content":[{{"type":"text","text":"Transcribe this."}},{part}]}}]}}"#
            )
        };
        for (kind, a, b) in [
            (
                "audio_url",
                r#"{"url":"https://x/a.wav"}"#,
                r#"{"url":"https://x/b.wav"}"#,
            ),
            ("image_embeds", r#""AAAA""#, r#""BBBB""#),
            ("audio_embeds", r#""AAAA""#, r#""BBBB""#),
            ("image_pil", r#""AAAA""#, r#""BBBB""#),
        ] {
            let part = |v: &str| format!(r#"{{"type":"{kind}","{kind}":{v}}}"#);
            let (first, second) = (ask(&part(a)), ask(&part(b)));
            assert_ne!(
                chain(&first, Api::Chat, &c),
                chain(&second, Api::Chat, &c),
                "{kind}"
            );
            let stream = [
                &br#"system"You transcribe audio files faithfully."user"Transcribe this."#[..],
                &media(kind, &[(kind, a)]),
                b"\"",
            ]
            .concat();
            assert_eq!(
                chain(&first, Api::Chat, &c),
                direct(Domain::Chat, &stream, Some("m"), &c),
                "{kind}"
            );
            check_against_reference(&first, Api::Chat, &c);
        }
    }

    #[test]
    fn a_cache_control_marker_moving_off_a_media_block_keeps_the_prefix() {
        // Anthropic clients mark their newest blocks with `cache_control` and drop the marker
        // from older ones the next turn; the engines ignore it.
        let c = cfg(64, 4, 512);
        let data: String = (0..3000)
            .map(|i| (b'A' + (i * 7 % 26) as u8) as char)
            .collect();
        for source in [
            json!({"type":"base64","media_type":"image/png","data":data}),
            json!({"type":"url","url":"https://example.com/cat.png"}),
        ] {
            let image = json!({"type":"image","source":source});
            let mut marked = image.clone();
            marked["cache_control"] = json!({"type":"ephemeral"});
            let ask = json!({"type":"text","text":"What is in this picture?"});
            let turn1 = json!({"model":"m","max_tokens":8,"messages":[
                {"role":"user","content":[ask, marked]}]})
            .to_string();
            let turn2 = json!({"model":"m","max_tokens":8,"messages":[
                {"role":"user","content":[ask, image]},
                {"role":"assistant","content":"A cat sitting on a mat, looking at the camera."},
                {"role":"user","content":[{"type":"text","text":"What colour is the cat?",
                    "cache_control":{"type":"ephemeral"}}]}]})
            .to_string();
            let (a, b) = (
                chain(&turn1, Api::Messages, &c),
                chain(&turn2, Api::Messages, &c),
            );
            assert!(a.len() >= 3 && b.len() > a.len(), "{} {}", a.len(), b.len());
            assert_eq!(&b[..a.len()], &a[..], "turn 2 of {turn1}");
            assert_eq!(
                opening(&turn1, Api::Messages, &c),
                opening(&turn2, Api::Messages, &c)
            );
        }
    }

    /// A tenant's `cache_salt` (and SGLang's `extra_key`, `lora_path`) gets its own cache in the
    /// engine: requests that differ in one share no block, wherever it stands; the same value
    /// gives the same chain, `null` reads as absent, the last copy counts, and two members
    /// swapping their values do not give the chain back. Every API reads them.
    #[test]
    fn cache_splitting_members_seed_the_chain() {
        let c = cfg(16, 4, 64);
        let messages = r#""messages":[{"role":"system","content":"You are the support agent of a shop."},{"role":"user","content":"Where is my order, please?"}]"#;
        let plain = chain(&format!(r#"{{"model":"m",{messages}}}"#), Api::Chat, &c);
        assert!(plain.len() >= 4);
        let with = |members: &str| {
            chain(
                &format!(r#"{{"model":"m",{members},{messages}}}"#),
                Api::Chat,
                &c,
            )
        };
        let tenant_a = with(r#""cache_salt":"tenant-a""#);
        let tenant_b = with(r#""cache_salt":"tenant-b""#);
        assert!(
            tenant_a.iter().zip(&plain).all(|(x, y)| x != y),
            "a salt changes every block"
        );
        assert!(
            tenant_a.iter().zip(&tenant_b).all(|(x, y)| x != y),
            "another salt, another chain"
        );
        let after = chain(
            &format!(r#"{{"model":"m",{messages},"cache_salt":"tenant-a"}}"#),
            Api::Chat,
            &c,
        );
        assert_eq!(after, tenant_a, "where the salt stands");
        assert_eq!(with(r#""cache_salt":null"#), plain, "null is absent");
        assert_eq!(
            with(r#""cache_salt":"tenant-b","cache_salt":"tenant-a""#),
            tenant_a,
            "the last copy counts"
        );
        for member in ["extra_key", "lora_path"] {
            let one = with(&format!(r#""{member}":"x""#));
            assert!(one.iter().zip(&plain).all(|(x, y)| x != y), "{member}");
            assert_ne!(one, with(&format!(r#""{member}":"y""#)), "{member}");
        }
        let swapped = [
            with(r#""cache_salt":"p","extra_key":"q""#),
            with(r#""cache_salt":"q","extra_key":"p""#),
        ];
        assert!(swapped[0].iter().zip(&swapped[1]).all(|(x, y)| x != y));
        assert!(swapped[0].iter().zip(&plain).all(|(x, y)| x != y));
        // SGLang's /generate takes the adapter with the text.
        let generate = |members: &str| {
            chain(
                &format!(
                    r#"{{"text":"You are the support agent of a shop. Where is my order, please?"{members}}}"#
                ),
                Api::Generate,
                &c,
            )
        };
        assert_ne!(generate(r#","lora_path":"adapter-1""#), generate(""));
        assert_eq!(generate(r#","lora_path":null"#), generate(""));
    }

    /// The tool definitions are rendered into the prompt near its start: requests with other
    /// tools share nothing, wherever `tools` stands in the body; no tools, `null` and `[]` read
    /// alike. APIs without tools ignore the member.
    #[test]
    fn tool_definitions_seed_the_chain() {
        let c = cfg(16, 4, 64);
        let messages = r#""messages":[{"role":"system","content":"You are an agent with tools."},{"role":"user","content":"List the files in the current folder, please."}]"#;
        let tools_a = r#"[{"type":"function","function":{"name":"ls","parameters":{}}}]"#;
        let tools_b = r#"[{"type":"function","function":{"name":"cat","parameters":{}}}]"#;
        let with = |tools: &str| format!(r#"{{"model":"m",{messages},"tools":{tools}}}"#);
        let without = chain(&format!(r#"{{"model":"m",{messages}}}"#), Api::Chat, &c);
        assert!(without.len() >= 4);
        let a = chain(&with(tools_a), Api::Chat, &c);
        assert_eq!(a.len(), without.len());
        assert!(
            a.iter().zip(&without).all(|(x, y)| x != y),
            "tools change every block"
        );
        let b = chain(&with(tools_b), Api::Chat, &c);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x != y),
            "other tools, other chain"
        );
        let before = format!(r#"{{"tools":{tools_a},"model":"m",{messages}}}"#);
        assert_eq!(chain(&before, Api::Chat, &c), a, "where `tools` stands");
        let twice = format!(r#"{{"tools":{tools_b},"model":"m",{messages},"tools":{tools_a}}}"#);
        assert_eq!(chain(&twice, Api::Chat, &c), a, "the last `tools` wins");
        for none in ["null", "[]", "[ \n ]"] {
            assert_eq!(chain(&with(none), Api::Chat, &c), without, "tools {none}");
        }
        let unset = format!(r#"{{"tools":{tools_a},"model":"m",{messages},"tools":null}}"#);
        assert_eq!(chain(&unset, Api::Chat, &c), without, "a later null unsets");
        // Responses and Messages read it too; completions take no tools.
        let input = r#""input":"List the files in the current folder, please.","instructions":"You are an agent with tools.""#;
        let responses = |tools: &str| {
            chain(
                &format!(r#"{{"model":"m",{input},"tools":{tools}}}"#),
                Api::Responses,
                &c,
            )
        };
        assert_ne!(responses(tools_a), responses(tools_b));
        assert_eq!(
            responses("null"),
            chain(&format!(r#"{{"model":"m",{input}}}"#), Api::Responses, &c)
        );
        let anthropic = |tools: &str| {
            chain(
                &format!(r#"{{"model":"m","system":"You are an agent with tools.",{messages},"tools":{tools}}}"#)
                    .replace(r#"{"role":"system","content":"You are an agent with tools."},"#, ""),
                Api::Messages,
                &c,
            )
        };
        assert_ne!(anthropic(tools_a), anthropic(tools_b));
        assert!(!anthropic(tools_a).is_empty());
        let prompt =
            r#""prompt":"List the files in the current folder, please, and then some more.""#;
        assert_eq!(
            chain(
                &format!(r#"{{"model":"m",{prompt},"tools":{tools_a}}}"#),
                Api::Completions,
                &c
            ),
            chain(
                &format!(r#"{{"model":"m",{prompt}}}"#),
                Api::Completions,
                &c
            )
        );
    }

    #[test]
    fn chat_tool_calls_are_part_of_the_prompt() {
        let c = cfg(8, 2, 64);
        let body = |call: &str| {
            format!(
                r#"{{"messages":[{{"role":"user","content":"what is the weather there"}},
                {{"role":"assistant","content":null,"tool_calls":[{call}]}},
                {{"role":"tool","tool_call_id":"call_1","content":"sunny"}}]}}"#
            )
        };
        let lisbon = body(
            r#"{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Lisbon\"}"}}"#,
        );
        let want = direct(
            Domain::Chat,
            br#"user"what is the weather there"assistant""get_weather"{\"city\":\"Lisbon\"}"tool"sunny""#,
            None,
            &c,
        );
        assert_eq!(chain(&lisbon, Api::Chat, &c), want);
        // Member order inside the call and the function does not matter; the id is not read.
        let reordered = body(
            r#"{"function":{"arguments":"{\"city\":\"Lisbon\"}","name":"get_weather"},"type":"function","id":"call_9"}"#,
        );
        assert_eq!(chain(&reordered, Api::Chat, &c), want);
        // Another call, with the same result, is another prompt.
        let other = body(
            r#"{"id":"call_1","type":"function","function":{"name":"delete_account","arguments":"{\"user\":\"bob\"}"}}"#,
        );
        assert_ne!(chain(&other, Api::Chat, &c), want);
        // Tool calls before the content and the role: the same stream. Arguments sent as an
        // object are read as their raw JSON; several calls follow one another.
        let first = r#"{"messages":[{"tool_calls":[{"function":{"name":"a","arguments":{"x":1}}},{"function":{"name":"b","arguments":"2"}}],"content":"hm","role":"assistant"}]}"#;
        assert_eq!(
            chain(first, Api::Chat, &c),
            direct(Domain::Chat, br#"assistant"hm"a"{"x":1}"b"2""#, None, &c)
        );
        // (The reference reads decoded strings: only bodies without escapes compare.)
        check_against_reference(first, Api::Chat, &c);
        check_against_reference(
            &body(r#"{"function":{"name":"f","arguments":"x"}}"#),
            Api::Chat,
            &c,
        );
    }

    #[test]
    fn completions_and_generate_forms() {
        let c = cfg(8, 2, 64);
        let text = "the quick brown fox jumps over the lazy dog";
        let s = format!(r#"{{"model":"m","prompt":"{text}"}}"#);
        let want = direct(Domain::Text, text.as_bytes(), Some("m"), &c);
        assert_eq!(want.len(), text.len() / 8);
        assert_eq!(chain(&s, Api::Completions, &c), want);
        // /generate's `text` is the same prompt: the same chain (same tokens, same cache).
        let g = format!(r#"{{"text":"{text}","model":"m"}}"#);
        assert_eq!(chain(&g, Api::Generate, &c), want);
        // A batch of strings: each followed by a separator.
        let list = r#"{"model":"m","prompt":["the quick brown fox","jumps over the lazy dog"]}"#;
        assert_eq!(
            chain(list, Api::Completions, &c),
            direct(
                Domain::Text,
                b"the quick brown fox\"jumps over the lazy dog\"",
                Some("m"),
                &c
            )
        );
        // Token ids: blocks of `block_tokens` ids, the same in both APIs.
        let tok = r#"{"model":"m","prompt":[1,2,3,4,5,4294967294,0]}"#;
        let want = direct(
            Domain::Tokens,
            &ids(&[1, 2, 3, 4, 5, u32::MAX - 1]),
            Some("m"),
            &c,
        );
        assert_eq!(want.len(), 3);
        assert_eq!(chain(tok, Api::Completions, &c), want);
        let gen = r#"{"input_ids":[1,2,3,4,5,4294967294,0],"model":"m"}"#;
        assert_eq!(chain(gen, Api::Generate, &c), want);
        // The other of /generate's two prompt members sent as null is absent, before or after.
        let gen_null = r#"{"text":null,"input_ids":[1,2,3,4,5,4294967294,0],"model":"m"}"#;
        let gen_null_after = r#"{"input_ids":[1,2,3,4,5,4294967294,0],"text": null}"#;
        assert_eq!(chain(gen_null, Api::Generate, &c), want);
        assert_eq!(
            chain(gen_null_after, Api::Generate, &c),
            direct(
                Domain::Tokens,
                &ids(&[1, 2, 3, 4, 5, u32::MAX - 1]),
                None,
                &c
            )
        );
        let g_null = format!(r#"{{"input_ids":null,"text":"{text}","model":"m"}}"#);
        let g_null_after = format!(r#"{{"text":"{text}","model":"m","input_ids":null}}"#);
        let text_want = direct(Domain::Text, text.as_bytes(), Some("m"), &c);
        assert_eq!(chain(&g_null, Api::Generate, &c), text_want);
        assert_eq!(chain(&g_null_after, Api::Generate, &c), text_want);
        // A later null replaces the same member's earlier value (the last one wins): the other
        // member's value is the prompt, or there is none.
        let text_then_null = format!(
            r#"{{"input_ids":[1,2,3,4,5,4294967294,0],"text":"{text}","model":"m","text":null}}"#
        );
        assert_eq!(chain(&text_then_null, Api::Generate, &c), want);
        let ids_then_null = format!(
            r#"{{"text":"{text}","input_ids":[1,2,3,4,5,4294967294,0],"input_ids":null,"model":"m"}}"#
        );
        assert_eq!(chain(&ids_then_null, Api::Generate, &c), text_want);
        let only_null = format!(r#"{{"text":"{text}","text":null,"model":"m"}}"#);
        assert_eq!(
            chain(&only_null, Api::Generate, &c),
            chain(r#"{"model":"m"}"#, Api::Generate, &c)
        );
        assert!(chain(&only_null, Api::Generate, &c).is_empty());
        for body in [
            gen_null,
            gen_null_after,
            &g_null,
            &g_null_after,
            &text_then_null,
            &ids_then_null,
            &only_null,
        ] {
            check_against_reference(body, Api::Generate, &c);
        }
        let lists = r#"{"prompt":[[1,2,3],[4]]}"#;
        assert_eq!(
            chain(lists, Api::Completions, &c),
            direct(
                Domain::Tokens,
                &ids(&[1, 2, 3, SEP_TOKEN, 4, SEP_TOKEN]),
                None,
                &c
            )
        );
        for body in [s.as_str(), g.as_str(), list, tok, gen, lists] {
            check_against_reference(body, Api::Completions, &c);
            check_against_reference(body, Api::Generate, &c);
        }
        // Text and tokens never share a chain, nor does chat.
        let as_text = direct(Domain::Text, &ids(&[1, 2, 3, 4]), None, &c);
        assert_ne!(
            as_text,
            direct(Domain::Tokens, &ids(&[1, 2, 3, 4]), None, &c)
        );
        assert_ne!(as_text, direct(Domain::Chat, &ids(&[1, 2, 3, 4]), None, &c));
    }

    #[test]
    fn unusable_or_missing_prompts_give_an_empty_chain() {
        let c = cfg(4, 1, 64);
        let cases: &[(&str, Api)] = &[
            (r#"{}"#, Api::Chat),
            (r#"{"model":"m"}"#, Api::Chat),
            (r#"{"messages":[]}"#, Api::Chat),
            (r#"{"messages":"hello hello hello"}"#, Api::Chat),
            (r#"{"messages":["hello hello hello"]}"#, Api::Chat),
            (r#"{"messages":[{"role":"user","content":5}]}"#, Api::Chat),
            (
                r#"{"messages":[{"role":7,"content":"hello hello"}]}"#,
                Api::Chat,
            ),
            (
                r#"{"messages":[{"role":"user","content":"hello hello","content":"x"}]}"#,
                Api::Chat,
            ),
            (
                r#"{"messages":[{"role":"user","role":"user","content":"hello hello"}]}"#,
                Api::Chat,
            ),
            (
                r#"{"messages":[{"role":"user","content":["hi there you"]}]}"#,
                Api::Chat,
            ),
            (r#"{"prompt":"hello hello"}"#, Api::Chat),
            (r#"{"prompt":""}"#, Api::Completions),
            (r#"{"prompt":[]}"#, Api::Completions),
            (r#"{"prompt":null}"#, Api::Completions),
            (r#"{"prompt":{"a":"hello hello"}}"#, Api::Completions),
            (r#"{"prompt":["hello hello",3]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,-4,5]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,4.0]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,1e2]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,4294967295]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,99999999999]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,"x"]}"#, Api::Completions),
            (r#"{"prompt":[[1,2],3]}"#, Api::Completions),
            (
                r#"{"messages":[{"role":"user","content":"hello hello"}]}"#,
                Api::Generate,
            ),
        ];
        for (body, api) in cases {
            assert!(chain(body, *api, &c).is_empty(), "{body}");
        }
        // Short of one block: nothing to hash either.
        assert!(chain(r#"{"prompt":"abc"}"#, Api::Completions, &c).is_empty());
        assert_eq!(chain(r#"{"prompt":"abcd"}"#, Api::Completions, &c).len(), 1);
        // The last duplicate of a prompt member wins, as in serde and Python.
        let dup = r#"{"prompt":"aaaaaaaa","prompt":"bbbbbbbb"}"#;
        assert_eq!(
            chain(dup, Api::Completions, &c),
            chain(r#"{"prompt":"bbbbbbbb"}"#, Api::Completions, &c)
        );
        let spoiled_then_fine = r#"{"prompt":[-1],"prompt":"bbbbbbbb"}"#;
        assert_eq!(chain(spoiled_then_fine, Api::Completions, &c).len(), 2);
    }

    #[test]
    fn malformed_bodies_are_errors() {
        let c = PrefixConfig::default();
        let h = hasher();
        for (body, err) in [
            ("", ScanError::NotAnObject),
            ("[]", ScanError::NotAnObject),
            ("\"x\"", ScanError::NotAnObject),
        ] {
            assert_eq!(
                prompt_chain(body.as_bytes(), Api::Chat, &c, &h),
                Err(err),
                "{body}"
            );
        }
        for body in [
            r#"{"messages":[{"role":"user","content":"hi"}]"#,
            r#"{"messages":[{"role":"user","content":"hi"},]}"#,
            r#"{"messages":[{"role":"user","content":"hi\x"}]}"#,
            r#"{"messages":[{"role":"user" "content":"hi"}]}"#,
            r#"{"messages":[{"content":"hi","role":"user"]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"]}]}"#,
            r#"{"prompt":[1,2,03]}"#,
            r#"{"prompt":[1,2,3,]}"#,
            r#"{"prompt":[1,2,-]}"#,
            r#"{"prompt":"x"}}"#,
            r#"{"model":"m","prompt":"x""#,
        ] {
            for api in [Api::Chat, Api::Completions] {
                assert!(
                    prompt_chain(body.as_bytes(), api, &c, &h).is_err(),
                    "{body} accepted"
                );
            }
        }
    }

    #[test]
    fn deep_nesting_does_not_recurse() {
        let c = cfg(4, 1, 64);
        let h = hasher();
        let deep =
            |open: &str, close: &str| format!("{}{}", open.repeat(100_000), close.repeat(100_000));
        let arrays = deep("[", "]");
        let objects = deep("{\"a\":", "}").replace(":}", ":1}");
        for (inner, ok) in [(arrays.as_str(), true), (&arrays[1..], false)] {
            for body in [
                format!(r#"{{"messages":{inner}}}"#),
                format!(r#"{{"messages":[{inner}]}}"#),
                format!(r#"{{"messages":[{{"role":"user","content":{inner}}}]}}"#),
                format!(r#"{{"messages":[{{"role":"user","content":[{inner}]}}]}}"#),
                format!(r#"{{"messages":[{{"content":[{{"type":"text","x":{inner}}}]}}]}}"#),
                format!(r#"{{"prompt":{inner}}}"#),
                format!(r#"{{"prompt":[[1],{inner}]}}"#),
                format!(r#"{{"other":{inner},"prompt":"abcdefgh"}}"#),
            ] {
                for api in [Api::Chat, Api::Completions] {
                    let r = prompt_chain(body.as_bytes(), api, &c, &h);
                    assert_eq!(r.is_ok(), ok, "{}", &body[..40]);
                }
            }
        }
        let body = format!(r#"{{"x":{objects},"prompt":"abcdefgh"}}"#);
        assert_eq!(chain(&body, Api::Completions, &c).len(), 2);
    }

    #[test]
    fn escapes_are_hashed_raw() {
        let c = cfg(4, 1, 64);
        // Same bytes, same chain; the same text escaped differently is another chain (documented).
        let a = r#"{"prompt":"line\none\u00e9\"q\"\\"}"#;
        let b = r#"{"prompt":"line\u000aone\u00e9\"q\"\\"}"#;
        assert_eq!(
            chain(a, Api::Completions, &c),
            direct(Domain::Text, br#"line\none\u00e9\"q\"\\"#, None, &c)
        );
        assert_ne!(
            chain(a, Api::Completions, &c),
            chain(b, Api::Completions, &c)
        );
        // Escaped member names are still recognised (names are unescaped, values are not).
        let named = r#"{"pr\u006fmpt":"abcdefgh","m\u006fdel":"m"}"#;
        assert_eq!(
            chain(named, Api::Completions, &c),
            direct(Domain::Text, b"abcdefgh", Some("m"), &c)
        );
    }

    #[test]
    fn model_seeds_the_chain_wherever_it_is() {
        let c = cfg(4, 1, 64);
        let first = r#"{"model":"a","prompt":"abcdefghijkl"}"#;
        let last = r#"{"prompt":"abcdefghijkl","model":"a"}"#;
        let other = r#"{"prompt":"abcdefghijkl","model":"b"}"#;
        let none = r#"{"prompt":"abcdefghijkl"}"#;
        let empty = r#"{"prompt":"abcdefghijkl","model":""}"#;
        let not_string = r#"{"prompt":"abcdefghijkl","model":7}"#;
        let dup = r#"{"model":"b","prompt":"abcdefghijkl","model":"a"}"#;
        let a = chain(first, Api::Completions, &c);
        assert_eq!(a.len(), 3);
        assert_eq!(chain(last, Api::Completions, &c), a);
        assert_eq!(chain(dup, Api::Completions, &c), a, "last model wins");
        assert_eq!(
            chain(not_string, Api::Completions, &c),
            chain(none, Api::Completions, &c)
        );
        for x in [other, none, empty] {
            let x = chain(x, Api::Completions, &c);
            assert!(a.iter().zip(&x).all(|(p, q)| p != q), "no shared hash");
        }
        assert_ne!(
            chain(none, Api::Completions, &c),
            chain(empty, Api::Completions, &c)
        );
    }

    #[test]
    fn seed_changes_every_hash() {
        let c = cfg(4, 1, 64);
        let body = br#"{"prompt":"abcdefghijkl"}"#;
        let a = prompt_chain(body, Api::Completions, &c, &PrefixHasher::new(b"")).unwrap();
        let b = prompt_chain(body, Api::Completions, &c, &PrefixHasher::new(b"x")).unwrap();
        assert!(a.hashes().iter().zip(b.hashes()).all(|(p, q)| p != q));
    }

    #[test]
    fn chains_extend_cap_and_drop_the_partial_block() {
        let c = cfg(16, 4, 10);
        let turn = |n: usize| {
            let mut msgs = vec![json!({"role":"system","content":"You are terse. ".repeat(5)})];
            for i in 0..n {
                msgs.push(json!({"role":"user","content":format!("question {i} ").repeat(3)}));
                msgs.push(json!({"role":"assistant","content":format!("answer {i}")}));
            }
            json!({"model":"m","messages":msgs}).to_string()
        };
        let one = chain(&turn(1), Api::Chat, &c);
        let two = chain(&turn(2), Api::Chat, &c);
        assert!(one.len() < two.len());
        // The block holding the end of turn 1 differs (turn 2 continues it); all before agree.
        let stream1 = reference(&serde_json::from_str(&turn(1)).unwrap(), Api::Chat)
            .unwrap()
            .1;
        let full = stream1.len() / 16;
        assert_eq!(one.len(), full, "partial last block not hashed");
        assert_eq!(one[..full], two[..full]);
        // Capped at max_blocks; a prompt beyond the cap keeps the same chain.
        let long = chain(&turn(40), Api::Chat, &c);
        assert_eq!(long.len(), 10);
        assert_eq!(chain(&turn(41), Api::Chat, &c), long);
        let capped = prompt_chain(turn(40).as_bytes(), Api::Chat, &c, &hasher()).unwrap();
        assert!(capped.capped());
        assert!(!prompt_chain(turn(1).as_bytes(), Api::Chat, &c, &hasher())
            .unwrap()
            .capped());
        // Exactly n blocks of text: n hashes.
        for n in 0..5 {
            let body = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(16 * n));
            assert_eq!(chain(&body, Api::Completions, &c).len(), n);
        }
    }

    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = splitmix(self.0);
            self.0 % n
        }

        fn text(&mut self, k: u64) -> String {
            const WORDS: [&str; 8] = [
                "alpha ", "beta ", "gamma", " delta ", "é ", "日本 ", "", "x",
            ];
            (0..k).map(|_| WORDS[self.below(8) as usize]).collect()
        }
    }

    /// An object with its members in the given order (serde_json's map would sort them).
    fn object(members: &[(&str, String)]) -> String {
        let inner: Vec<String> = members.iter().map(|(k, v)| format!("{k:?}:{v}")).collect();
        format!("{{{}}}", inner.join(","))
    }

    /// Random chat bodies (random member order, parts, extra members, model anywhere) against
    /// the serde reference.
    #[test]
    fn random_chat_bodies_match_the_reference() {
        let mut r = Rng(99);
        for _ in 0..2000 {
            let block = [1, 3, 8, 16, 40][r.below(5) as usize];
            let c = cfg(block, 2, 1 + r.below(30) as u32);
            let mut msgs = Vec::new();
            for _ in 0..r.below(6) {
                let content = match r.below(4) {
                    0 => "null".to_string(),
                    1 => {
                        let parts: Vec<String> = (0..r.below(4))
                            .map(|_| match r.below(3) {
                                0 => object(&[
                                    ("type", json!("text").to_string()),
                                    ("text", json!(r.text(3)).to_string()),
                                ]),
                                1 => object(&[
                                    ("text", json!(r.text(2)).to_string()),
                                    ("type", json!("text").to_string()),
                                ]),
                                // Keys in serde's order: the reference reads a media
                                // part's raw JSON as serde writes it.
                                _ => object(&[
                                    ("image_url", json!({"url":"u"}).to_string()),
                                    ("type", json!("image_url").to_string()),
                                ]),
                            })
                            .collect();
                        format!("[{}]", parts.join(","))
                    }
                    _ => {
                        let words = r.below(12);
                        json!(r.text(words)).to_string()
                    }
                };
                let mut members =
                    vec![("role", json!(r.text(1)).to_string()), ("content", content)];
                if r.below(2) == 0 {
                    members.reverse();
                }
                if r.below(3) == 0 {
                    let at = r.below(3) as usize;
                    members.insert(at, ("name", json!({"n":[1,2,{"k":"v"}]}).to_string()));
                }
                if r.below(5) == 0 {
                    members.retain(|(k, _)| *k != "role");
                }
                msgs.push(object(&members));
            }
            let mut top = vec![
                ("messages", format!("[{}]", msgs.join(","))),
                ("temperature", "0.5".to_string()),
                ("routing_key", "\"k\"".to_string()),
            ];
            if r.below(4) != 0 {
                let at = r.below(4) as usize;
                top.insert(at, ("model", json!(r.text(2)).to_string()));
            }
            check_against_reference(&object(&top), Api::Chat, &c);
        }
    }

    #[test]
    fn grammar_agrees_with_scan_top_level_on_mutated_bodies() {
        let seeds = [
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi \"there\""}]},{"content":"yo","role":"assistant"}],"stream":true}"#,
            r#"{"prompt":[[1,2,3],[4,5]],"model":"m","n":-1.5e3}"#,
            r#"{"input_ids":[1,20,300,4000],"text":"abc\u00e9","sampling_params":{"max_new_tokens":8}}"#,
            r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"q"}]},{"type":"function_call","name":"f","arguments":"{}"}],"instructions":"s","previous_response_id":null}"#,
            r#"{"messages":[{"role":"assistant","content":[{"type":"tool_use","name":"f","input":{"a":[1]}}]},{"role":"user","content":[{"type":"tool_result","content":[{"type":"text","text":"r"}]}]}],"system":[{"type":"text","text":"s"}]}"#,
        ];
        let c = cfg(4, 2, 16);
        let h = hasher();
        let alphabet = b"{}[]\":,\\ 0123456789-.eEtrufalsn\"xu";
        let mut r = 7u64;
        for seed in seeds {
            for _ in 0..4000 {
                let mut b = seed.as_bytes().to_vec();
                for _ in 0..1 + splitmix(r) % 3 {
                    r = splitmix(r);
                    let at = (r % b.len() as u64) as usize;
                    let c = alphabet[(r >> 32) as usize % alphabet.len()];
                    match (r >> 20) % 4 {
                        0 => b[at] = c,
                        1 => b.insert(at, c),
                        2 => {
                            b.remove(at);
                        }
                        _ => b.truncate(at),
                    }
                    if b.is_empty() {
                        b.push(b'{');
                    }
                }
                let top = scan_top_level(&b, &[], |_, _| {}).is_ok();
                for api in [
                    Api::Chat,
                    Api::Completions,
                    Api::Generate,
                    Api::Responses,
                    Api::Messages,
                ] {
                    let ours = prompt_chain(&b, api, &c, &h);
                    assert_eq!(
                        ours.is_ok(),
                        top,
                        "{:?} on {}",
                        ours,
                        String::from_utf8_lossy(&b)
                    );
                }
            }
        }
    }

    #[test]
    fn wanted_fields_are_reported_like_scan_top_level() {
        let c = PrefixConfig::default();
        let h = hasher();
        let wanted = ["routing_key", "model", "messages", "user", "routed_dp_rank"];
        for body in [
            r#"{"model":"m\u00e9","messages":[{"role":"user","content":"x"}],"routing_key":"a\nb","routed_dp_rank":3,"user":null}"#,
            r#"{"user":"u","routing_key":"k","routing_key":"k2","messages":[]}"#,
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        ] {
            let mut ours = Vec::new();
            let mut theirs = Vec::new();
            scan_prompt(body.as_bytes(), Api::Chat, &c, &h, &wanted, |i, v| {
                ours.push((i, v))
            })
            .unwrap();
            scan_top_level(body.as_bytes(), &wanted, |i, v| theirs.push((i, v))).unwrap();
            assert_eq!(ours, theirs, "{body}");
        }
    }

    #[test]
    fn swar_digits_agree_with_a_loop() {
        let mut r = Rng(5);
        for _ in 0..200_000 {
            let mut w = [0u8; 8];
            for b in &mut w {
                *b = match r.below(4) {
                    0 => b"0123456789,] .e-"[r.below(16) as usize],
                    _ => b'0' + r.below(10) as u8,
                };
            }
            if r.below(3) == 0 {
                w[r.below(8) as usize] = r.below(256) as u8;
            }
            let len = w.iter().take_while(|b| b.is_ascii_digit()).count();
            let value = w[..len]
                .iter()
                .fold(0u64, |v, d| v * 10 + u64::from(d - b'0'));
            let got = swar_digits(u64::from_le_bytes(w));
            assert_eq!(got.0, len, "{w:?}");
            if len < 8 {
                assert_eq!(got.1, value, "{w:?}");
            }
        }
    }

    #[test]
    fn api_from_path() {
        for (path, api) in [
            ("/v1/chat/completions", Some(Api::Chat)),
            ("/v1/chat/completions?x=1", Some(Api::Chat)),
            ("/openai/v1/chat/completions/", Some(Api::Chat)),
            ("/v1/completions", Some(Api::Completions)),
            ("/generate", Some(Api::Generate)),
            ("/generate?stream=1", Some(Api::Generate)),
            ("/v1/responses", Some(Api::Responses)),
            ("/v1/responses?x=1", Some(Api::Responses)),
            ("/v1/responses/resp_1", None),
            ("/v1/responses/resp_1/cancel", None),
            ("/v1/messages", Some(Api::Messages)),
            ("/v1/messages/count_tokens", None),
            ("/v1/models", None),
            ("/", None),
            ("", None),
            ("/v1/embeddings", None),
        ] {
            assert_eq!(Api::from_path(path.as_bytes()), api, "{path}");
        }
    }
}
