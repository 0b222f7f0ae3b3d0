//! Setting or removing top-level members of a JSON request body, byte for byte.
//!
//! An engine that reads the rank from the body on some path (SGLang's `/generate` reads only
//! `routed_dp_rank`) is told the rank by rewriting the buffered body: the rank member is given
//! the rank (every copy of it, or a new member right after the `{` when there is none), the
//! rank members a client may not send are removed, and every other byte stays as the client
//! sent it (prompt text, escapes, whitespace, member order). The body is walked once by the
//! same scanner that reads the routing fields; nothing is parsed into a tree.
//!
//! Member names are compared after unescaping, as the engine's `json.loads` compares them:
//! `"routed\u005fdp_rank"` is `routed_dp_rank` to the engine, so it is to this module too.

use std::ops::Range;

use crate::json_scan::{ScanError, Scanner};

/// What to do to a body's top-level members.
#[derive(Debug, Clone, Copy)]
pub struct RankEdit<'a> {
    /// Give this member the rank (replacing every copy, or inserting it).
    pub set: Option<(&'a str, u32)>,
    /// Remove every copy of these members (a name also in `set` is set, not removed).
    pub remove: &'a [String],
}

/// A rewritten body and what changed in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewritten {
    pub body: Vec<u8>,
    /// The rank member now holds a value it did not hold before (set, replaced or inserted).
    pub rank_set: bool,
    /// Members removed.
    pub removed: usize,
}

/// One top-level member: where its name starts and where its value lies.
#[derive(Debug, Clone)]
struct Member {
    name_start: usize,
    value: Range<usize>,
    role: Role,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Keep,
    Set,
    Remove,
}

/// Applies `edit` to `body`, a JSON object. `Ok(None)`: nothing to change (the bytes would be
/// the same). `Err`: not a JSON object the scanner reads, so it cannot be edited safely.
pub fn rewrite(body: &[u8], edit: RankEdit<'_>) -> Result<Option<Rewritten>, ScanError> {
    let (open, members) = members(body, edit)?;
    let digits = edit.set.map(|(_, rank)| rank.to_string());
    let removed_ranges: Vec<Cut> = removals(&members)
        .into_iter()
        .map(|r| (r, Vec::new()))
        .collect();
    let mut cuts: Vec<Cut> = Vec::new();
    let mut rank_set = false;
    if let (Some((name, _)), Some(digits)) = (edit.set, &digits) {
        let copies: Vec<&Member> = members.iter().filter(|m| m.role == Role::Set).collect();
        for m in &copies {
            if body.get(m.value.clone()) != Some(digits.as_bytes()) {
                rank_set = true;
                cuts.push((m.value.clone(), digits.as_bytes().to_vec()));
            }
        }
        if copies.is_empty() {
            rank_set = true;
            let any_kept = members.iter().any(|m| m.role == Role::Keep);
            let mut member = serde_json::to_vec(name).unwrap_or_default();
            member.push(b':');
            member.extend_from_slice(digits.as_bytes());
            if any_kept {
                member.push(b',');
            }
            cuts.push((open + 1..open + 1, member));
        }
    }
    // Both runs are in document order (the inserted member, at the `{`, first of all).
    let cuts = merge_in_order(cuts, removed_ranges);
    if cuts.is_empty() {
        return Ok(None);
    }
    let removed = members.iter().filter(|m| m.role == Role::Remove).count();
    Ok(Some(Rewritten {
        body: splice(body, &cuts),
        rank_set,
        removed,
    }))
}

/// The position of the opening `{` and every top-level member, with its role under `edit`; a
/// run of kept members is one (from the first one's name to the last one's value): the edit
/// needs no more of them, and a body of millions of tiny members would otherwise cost a record
/// each, in a VM whose memory never shrinks.
fn members(body: &[u8], edit: RankEdit<'_>) -> Result<(usize, Vec<Member>), ScanError> {
    let (mut s, open, empty) = Scanner::open_object(body)?;
    let mut out = Vec::new();
    if empty {
        s.expect_end()?;
        return Ok((open, out));
    }
    loop {
        s.skip_ws();
        let name_start = s.i;
        let name = s.string()?;
        s.skip_ws();
        s.expect(b':')?;
        s.skip_ws();
        let value_start = s.i;
        s.skip_value()?;
        let role = if edit.set.is_some_and(|(n, _)| n.as_bytes() == &*name) {
            Role::Set
        } else if edit.remove.iter().any(|n| n.as_bytes() == &*name) {
            Role::Remove
        } else {
            Role::Keep
        };
        match out.last_mut() {
            Some(run) if role == Role::Keep && run.role == Role::Keep => run.value.end = s.i,
            _ => out.push(Member {
                name_start,
                value: value_start..s.i,
                role,
            }),
        }
        s.skip_ws();
        match s.next_byte()? {
            b',' => continue,
            b'}' => {
                s.expect_end()?;
                return Ok((open, out));
            }
            _ => return Err(ScanError::Syntax(s.i - 1)),
        }
    }
}

/// The byte ranges that remove the `Remove` members with one separating comma each, so the
/// rest stays a valid object: a member followed by a kept one goes up to that one's name; the
/// run of removed members at the end goes from the last kept value (its comma included).
fn removals(members: &[Member]) -> Vec<Range<usize>> {
    let last_kept = members.iter().rposition(|m| m.role != Role::Remove);
    let mut out = Vec::new();
    for (i, m) in members.iter().enumerate() {
        if m.role != Role::Remove {
            continue;
        }
        match (last_kept, members.get(i + 1)) {
            (Some(k), Some(next)) if i < k => out.push(m.name_start..next.name_start),
            _ => {}
        }
    }
    let trailing_from = match last_kept {
        Some(k) => members.get(k).map(|m| m.value.end),
        None => members.first().map(|m| m.name_start),
    };
    let trailing_removed = members.len() > last_kept.map_or(0, |k| k + 1);
    if let (Some(from), Some(last), true) = (trailing_from, members.last(), trailing_removed) {
        out.push(from..last.value.end);
    }
    out
}

/// A range of the body and the bytes that replace it.
type Cut = (Range<usize>, Vec<u8>);

/// Two lists of cuts, each in order of (start, end), merged into one such list. (A merge, not a
/// sort: the standard library's sorts would add kilobytes to the module for a few elements.)
fn merge_in_order(a: Vec<Cut>, b: Vec<Cut>) -> Vec<Cut> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut a, mut b) = (a.into_iter().peekable(), b.into_iter().peekable());
    loop {
        let a_first = match (a.peek(), b.peek()) {
            (Some((x, _)), Some((y, _))) => (x.start, x.end) <= (y.start, y.end),
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => return out,
        };
        out.extend(if a_first { a.next() } else { b.next() });
    }
}

/// `body` with each (sorted, disjoint) range replaced by its bytes.
fn splice(body: &[u8], cuts: &[Cut]) -> Vec<u8> {
    let grown: usize = cuts.iter().map(|(_, b)| b.len()).sum();
    let mut out = Vec::with_capacity(body.len() + grown);
    let mut at = 0;
    for (range, bytes) in cuts {
        out.extend_from_slice(body.get(at..range.start).unwrap_or_default());
        out.extend_from_slice(bytes);
        at = at.max(range.end);
    }
    out.extend_from_slice(body.get(at..).unwrap_or_default());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    /// The rewritten text, or the input when nothing changed.
    fn apply(body: &str, set: Option<(&str, u32)>, remove: &[&str]) -> String {
        let remove = fields(remove);
        let edit = RankEdit {
            set,
            remove: &remove,
        };
        match rewrite(body.as_bytes(), edit) {
            Ok(Some(r)) => String::from_utf8(r.body).expect("utf8"),
            Ok(None) => body.to_string(),
            Err(e) => panic!("{body:?}: {e:?}"),
        }
    }

    const RANK: Option<(&str, u32)> = Some(("routed_dp_rank", 3));

    /// (body, the member to set, the members to remove, the body wanted)
    type Case<'a> = (&'a str, Option<(&'a str, u32)>, &'a [&'a str], &'a str);

    #[test]
    fn sets_replaces_inserts_and_removes() {
        let alias = ["data_parallel_rank"];
        let cases: &[Case<'_>] = &[
            // Inserted right after the brace, everything else untouched.
            (
                r#"{"text":"hi"}"#,
                RANK,
                &[],
                r#"{"routed_dp_rank":3,"text":"hi"}"#,
            ),
            (r#"{}"#, RANK, &[], r#"{"routed_dp_rank":3}"#),
            (" { } ", RANK, &[], r#" {"routed_dp_rank":3 } "#),
            (
                "{ \"text\" : \"a\\u0022b\" }\n",
                RANK,
                &[],
                "{\"routed_dp_rank\":3, \"text\" : \"a\\u0022b\" }\n",
            ),
            // Replaced in place, whatever the old value was.
            (
                r#"{"text":"hi","routed_dp_rank":1}"#,
                RANK,
                &[],
                r#"{"text":"hi","routed_dp_rank":3}"#,
            ),
            (
                r#"{"routed_dp_rank" :  null , "x":[1,{"routed_dp_rank":0}]}"#,
                RANK,
                &[],
                r#"{"routed_dp_rank" :  3 , "x":[1,{"routed_dp_rank":0}]}"#,
            ),
            (
                r#"{"routed_dp_rank":"7","routed_dp_rank":{"a":[]}}"#,
                RANK,
                &[],
                r#"{"routed_dp_rank":3,"routed_dp_rank":3}"#,
            ),
            // An escaped name is the same member to the engine.
            (
                r#"{"routed\u005fdp_rank":0}"#,
                RANK,
                &[],
                r#"{"routed\u005fdp_rank":3}"#,
            ),
            // Removed with one comma, wherever they are.
            (
                r#"{"data_parallel_rank":1,"text":"hi"}"#,
                RANK,
                &alias,
                r#"{"routed_dp_rank":3,"text":"hi"}"#,
            ),
            (
                r#"{"text":"hi", "data_parallel_rank":1}"#,
                None,
                &alias,
                r#"{"text":"hi"}"#,
            ),
            (
                r#"{"a":1,"data_parallel_rank":1,"b":2}"#,
                None,
                &alias,
                r#"{"a":1,"b":2}"#,
            ),
            (r#"{ "data_parallel_rank":1 }"#, None, &alias, "{  }"),
            (
                r#"{"data_parallel_rank":1}"#,
                RANK,
                &alias,
                r#"{"routed_dp_rank":3}"#,
            ),
            (
                r#"{"routed_dp_rank":1,"data_parallel_rank":2,"a":0,"data_parallel_rank":5}"#,
                None,
                &["routed_dp_rank", "data_parallel_rank"],
                r#"{"a":0}"#,
            ),
            (
                r#"{"a":0,"routed_dp_rank":1,"data_parallel_rank":2}"#,
                None,
                &["routed_dp_rank", "data_parallel_rank"],
                r#"{"a":0}"#,
            ),
            (
                r#"{"routed_dp_rank":1,"data_parallel_rank":2}"#,
                None,
                &["routed_dp_rank", "data_parallel_rank"],
                "{}",
            ),
            // Copies set in place and aliases removed, interleaved: the two kinds of edit are
            // applied in document order.
            (
                r#"{"data_parallel_rank":1,"a":0,"routed_dp_rank":2,"x":1,"data_parallel_rank":3,"routed_dp_rank":4,"z":0}"#,
                RANK,
                &alias,
                r#"{"a":0,"routed_dp_rank":3,"x":1,"routed_dp_rank":3,"z":0}"#,
            ),
            (
                r#"{"routed_dp_rank":1,"a":0,"data_parallel_rank":2}"#,
                RANK,
                &alias,
                r#"{"routed_dp_rank":3,"a":0}"#,
            ),
            (
                r#"{"data_parallel_rank":1,"a":0,"data_parallel_rank":2}"#,
                RANK,
                &alias,
                r#"{"routed_dp_rank":3,"a":0}"#,
            ),
            // The set member is never removed, even when listed.
            (
                r#"{"routed_dp_rank":0}"#,
                RANK,
                &["routed_dp_rank"],
                r#"{"routed_dp_rank":3}"#,
            ),
        ];
        for (body, set, remove, want) in cases {
            assert_eq!(apply(body, *set, remove), *want, "{body}");
            serde_json::from_str::<serde_json::Value>(want).expect("the expectation is JSON");
        }
    }

    /// Kept members between the edited ones are one record each run, whatever their number, and
    /// the edit is the same as member by member.
    #[test]
    fn runs_of_kept_members_are_one_record() {
        let mut body = String::from("{");
        for i in 0..10_000 {
            body.push_str(&format!(r#""a{i}":1,"#));
        }
        body.push_str(r#""data_parallel_rank":2,"b":[1,2],"c":{},"routed_dp_rank":1,"d":"x"}"#);
        let remove = fields(&["data_parallel_rank"]);
        let edit = RankEdit {
            set: Some(("routed_dp_rank", 3)),
            remove: &remove,
        };
        let (_, got) = members(body.as_bytes(), edit).unwrap();
        let roles: Vec<Role> = got.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [Role::Keep, Role::Remove, Role::Keep, Role::Set, Role::Keep]
        );
        let out = apply(&body, Some(("routed_dp_rank", 3)), &["data_parallel_rank"]);
        let want = body
            .replace(r#""data_parallel_rank":2,"#, "")
            .replace(r#""routed_dp_rank":1"#, r#""routed_dp_rank":3"#);
        assert_eq!(out, want);
    }

    #[test]
    fn a_byte_order_mark_stays_in_front() {
        let body = b"\xEF\xBB\xBF{\"a\":1}";
        let r = rewrite(
            body,
            RankEdit {
                set: RANK,
                remove: &[],
            },
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.body, b"\xEF\xBB\xBF{\"routed_dp_rank\":3,\"a\":1}");
    }

    #[test]
    fn reports_what_changed() {
        let remove = fields(&["data_parallel_rank"]);
        let edit = RankEdit {
            set: RANK,
            remove: &remove,
        };
        let r = |b: &str| rewrite(b.as_bytes(), edit).unwrap();
        assert_eq!(r(r#"{"routed_dp_rank":3}"#), None, "already the rank");
        assert_eq!(r(r#"{"routed_dp_rank": 3 ,"x":1}"#), None);
        let changed = r(r#"{"routed_dp_rank":3,"data_parallel_rank":3}"#).unwrap();
        assert_eq!((changed.rank_set, changed.removed), (false, 1));
        let changed = r(r#"{"routed_dp_rank":3.0}"#).unwrap();
        assert!(changed.rank_set, "3.0 is not the integer the engine takes");
        let nothing = RankEdit {
            set: None,
            remove: &remove,
        };
        assert_eq!(rewrite(br#"{"a":1}"#, nothing).unwrap(), None);
    }

    #[test]
    fn refuses_what_is_not_an_object() {
        let edit = RankEdit {
            set: RANK,
            remove: &[],
        };
        for bad in [
            "",
            "[]",
            "1",
            "\"x\"",
            "{",
            "{\"a\"}",
            "{\"a\":1,}",
            "{\"a\":1} x",
            "{\"a\":tru}",
            "\u{feff}\u{feff}{}",
            " \u{feff}{}",
        ] {
            assert!(rewrite(bad.as_bytes(), edit).is_err(), "{bad:?}");
        }
    }
}
