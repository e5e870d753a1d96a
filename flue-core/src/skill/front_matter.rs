//! `SKILL.md`: YAML front matter between `---` lines, then the markdown body (the
//! instructions). The front matter is read as the Agent Skills format uses YAML: a mapping of
//! scalar fields (plain, single- or double-quoted (also over several lines), or `|` / `>`
//! block scalars with their chomping and indentation indicators) and a one-level `metadata`
//! mapping of strings (on the lines under it, or a flow mapping on its own line:
//! `metadata: {}`). Unknown fields are skipped whatever their value (a list, a flow
//! collection, a nested mapping), as the reference ignores them; a field this format knows
//! whose value is something else YAML allows (anchors, flow collections, a list, a nested
//! mapping, a scalar on `metadata`'s own line) is refused with its line, as is a key written
//! twice (YAML refuses that too).

use std::collections::BTreeMap;

/// The parsed document: top-level scalars, the `metadata` mapping, and the body.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct SkillMarkdown {
    pub(crate) fields: BTreeMap<String, String>,
    pub(crate) metadata: BTreeMap<String, String>,
    pub(crate) body: String,
}

/// Splits and parses `text`; the error says what is wrong and on which line.
pub(crate) fn parse(text: &str) -> Result<SkillMarkdown, String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text.lines();
    if lines.next().map(str::trim_end) != Some("---") {
        return Err("SKILL.md must start with a front matter block opened by a `---` line.".into());
    }
    let mut front = Vec::new();
    let mut closed = false;
    for line in lines.by_ref() {
        if line.trim_end() == "---" {
            closed = true;
            break;
        }
        front.push(line);
    }
    if !closed {
        return Err("SKILL.md front matter is not closed by a `---` line.".into());
    }
    let body = lines.collect::<Vec<_>>().join("\n");
    let mut document = SkillMarkdown {
        body: body.trim().to_owned(),
        ..SkillMarkdown::default()
    };
    let mut index = 0;
    let mut seen_metadata = false;
    while index < front.len() {
        let line = front[index];
        let number = index + 2; // 1-based, after the opening `---`
        index += 1;
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        if line.starts_with([' ', '\t']) {
            return Err(format!("line {number}: unexpected indentation."));
        }
        let (key, rest) = split_key(line).ok_or_else(|| format!("line {number}: expected `key: value`."))?;
        let key = unquote_key(key, number)?;
        if !KNOWN_FIELDS.contains(&key.as_str()) {
            // Skipped with whatever it holds, on this line and the indented ones under it (and
            // the items of a list written at the key's own indentation).
            while index < front.len() && (front[index].starts_with([' ', '\t', '-']) || front[index].trim().is_empty())
            {
                index += 1;
            }
            continue;
        }
        // YAML refuses a key written twice in one mapping (the reference's parser too).
        if document.fields.contains_key(&key) || (key == "metadata" && seen_metadata) {
            return Err(format!("line {number}: `{key}` is written twice."));
        }
        let rest = strip_comment(rest).trim();
        if key == "metadata" {
            seen_metadata = true;
            if !rest.is_empty() {
                // `metadata: {}` or `{author: ada, version: "1.0"}`: a mapping of strings on
                // one line.
                for (name, value) in flow_mapping(rest, number)? {
                    if document.metadata.contains_key(&name) {
                        return Err(format!("line {number}: metadata `{name}` is written twice."));
                    }
                    document.metadata.insert(name, value);
                }
                continue;
            }
            let mut indentation = None;
            while index < front.len() && (front[index].starts_with([' ', '\t']) || front[index].trim().is_empty()) {
                let entry = front[index];
                let number = index + 2;
                index += 1;
                if entry.trim().is_empty() || entry.trim_start().starts_with('#') {
                    continue;
                }
                let indented = entry.len() - entry.trim_start().len();
                if *indentation.get_or_insert(indented) != indented {
                    return Err(format!(
                        "line {number}: metadata values must be strings of one line (a nested mapping or a value continued is not read)."
                    ));
                }
                let (name, value) = split_key(entry.trim_start())
                    .ok_or_else(|| format!("line {number}: expected `key: value` under metadata."))?;
                let value = scalar(strip_comment(value).trim(), number)?;
                let name = unquote_key(name, number)?;
                if document.metadata.contains_key(&name) {
                    return Err(format!("line {number}: metadata `{name}` is written twice."));
                }
                document.metadata.insert(name, value);
            }
            continue;
        }
        let value = if is_block_header(rest) {
            let mut block = Vec::new();
            // The block's indentation is its first line's: a literal block keeps what its
            // lines are indented beyond it.
            let mut indentation = None;
            while index < front.len() && (front[index].starts_with([' ', '\t']) || front[index].trim().is_empty()) {
                let line = front[index].trim_end();
                // YAML indents with spaces (and tabs here): counted in those bytes only, so
                // the cut below never lands inside another whitespace character.
                let indented = line.len() - line.trim_start_matches([' ', '\t']).len();
                let kept = if line.is_empty() {
                    line
                } else {
                    &line[(*indentation.get_or_insert(indented)).min(indented)..]
                };
                block.push(if rest.starts_with('|') { kept } else { kept.trim_start() });
                index += 1;
            }
            let joined = if rest.starts_with('|') {
                block.join("\n")
            } else {
                fold(&block)
            };
            joined.trim_end().to_owned()
        } else if rest.starts_with(['"', '\'']) && closing_quote(rest).is_none() {
            // A quoted string that goes on over the next lines, folded as YAML folds them. The
            // lines joined grow as they are taken, and the closing quote is looked for in what
            // each adds only: a value of many lines costs what its length does.
            let mut lines = vec![rest];
            let mut joined = rest.to_owned();
            let mut closing = Closing::of(rest);
            while index < front.len() && closing.find(&joined).is_none() {
                if !front[index].starts_with([' ', '\t']) && !front[index].trim().is_empty() {
                    break;
                }
                lines.push(front[index].trim());
                joined.push(' ');
                joined.push_str(front[index].trim());
                index += 1;
            }
            let folded = fold(&lines);
            // A comment may follow the closing quote, as on one line.
            let value = match closing_quote(&folded) {
                Some(close)
                    if folded[close + 1..].trim().is_empty() || folded[close + 1..].trim_start().starts_with('#') =>
                {
                    &folded[..=close]
                }
                _ => folded.as_str(),
            };
            scalar(value, number)?
        } else {
            let mut value = scalar(rest, number)?;
            if rest.is_empty() && front.get(index).is_some_and(|next| next.trim_start().starts_with("- ")) {
                return Err(format!("line {}: `{key}` must be a string, not a list.", index + 2));
            }
            // `key:` over an indented `name: value` is a nested mapping to YAML, not text.
            if rest.is_empty()
                && front
                    .get(index)
                    .is_some_and(|next| next.starts_with([' ', '\t']) && split_key(next.trim_start()).is_some())
            {
                return Err(format!("line {}: `{key}` must be a string, not a mapping.", index + 2));
            }
            // A plain scalar may continue on indented lines (folded with spaces; a blank line
            // between them is a line break, as YAML folds it).
            if !rest.starts_with(['"', '\'']) {
                loop {
                    let blanks = front[index.min(front.len())..]
                        .iter()
                        .take_while(|line| line.trim().is_empty())
                        .count();
                    let Some(next) = front.get(index + blanks) else {
                        break;
                    };
                    if !next.starts_with([' ', '\t']) || next.trim_start().starts_with('#') && blanks > 0 {
                        break;
                    }
                    if blanks > 0 {
                        value.push_str(&"\n".repeat(blanks));
                    } else if !value.is_empty() {
                        value.push(' ');
                    }
                    value.push_str(next.trim());
                    index += blanks + 1;
                }
            }
            value
        };
        document.fields.insert(key, value);
    }
    Ok(document)
}

/// The fields this format reads; any other is skipped.
const KNOWN_FIELDS: [&str; 6] = [
    "name",
    "description",
    "license",
    "compatibility",
    "allowed-tools",
    "metadata",
];

/// Whether `header` opens a block scalar: `|` or `>`, with an optional chomping indicator
/// (`-`, `+`) and indentation indicator (a digit), in either order.
fn is_block_header(header: &str) -> bool {
    let mut rest = header.chars();
    if !matches!(rest.next(), Some('|' | '>')) {
        return false;
    }
    let indicators: Vec<char> = rest.collect();
    match indicators.as_slice() {
        [] => true,
        [one] => matches!(one, '-' | '+' | '1'..='9'),
        [a, b] => {
            (matches!(a, '-' | '+') && matches!(b, '1'..='9')) || (matches!(a, '1'..='9') && matches!(b, '-' | '+'))
        }
        _ => false,
    }
}

/// The byte position of the quote that closes the quoted string `value` starts with, if it
/// has one (a doubled `''` in single quotes and `\"` in double quotes are not it).
fn closing_quote(value: &str) -> Option<usize> {
    let quote = value.chars().next()?;
    let mut chars = value.char_indices().skip(1).peekable();
    while let Some((at, c)) = chars.next() {
        match (quote, c) {
            ('"', '\\') => {
                chars.next();
            }
            ('\'', '\'') if chars.peek().is_some_and(|(_, next)| *next == '\'') => {
                chars.next();
            }
            (quote, c) if c == quote => return Some(at),
            _ => {}
        }
    }
    None
}

/// [`closing_quote`] over a text that grows at its end, each character looked at once.
struct Closing {
    quote: char,
    /// Where the next look starts.
    next: usize,
    /// Whether the character at `next` is escaped (a `\` ended the text looked at).
    escaped: bool,
}

impl Closing {
    /// For the quoted string `value` starts with.
    fn of(value: &str) -> Self {
        let quote = value.chars().next().unwrap_or('"');
        Self {
            quote,
            next: quote.len_utf8(),
            escaped: false,
        }
    }

    /// The closing quote's byte position in `text` (what was looked at before, and more).
    fn find(&mut self, text: &str) -> Option<usize> {
        let mut chars = text.get(self.next..)?.char_indices().peekable();
        while let Some((offset, c)) = chars.next() {
            if std::mem::take(&mut self.escaped) {
                continue;
            }
            match (self.quote, c) {
                ('"', '\\') => self.escaped = true,
                ('\'', '\'') if chars.peek().is_some_and(|(_, next)| *next == '\'') => {
                    chars.next();
                }
                (quote, c) if c == quote => return Some(self.next + offset),
                _ => {}
            }
        }
        self.next = text.len();
        None
    }
}

fn split_key(line: &str) -> Option<(&str, &str)> {
    let (key, rest) = line.split_once(':')?;
    (!key.trim().is_empty() && (rest.is_empty() || rest.starts_with([' ', '\t']))).then(|| (key.trim(), rest))
}

fn unquote_key(key: &str, number: usize) -> Result<String, String> {
    if key.starts_with(['"', '\'']) {
        scalar(key, number)
    } else {
        Ok(key.to_owned())
    }
}

/// Drops a ` #` comment outside quotes (after a quoted string's closing quote too).
fn strip_comment(value: &str) -> &str {
    let trimmed = value.trim_start();
    if trimmed.starts_with(['"', '\'']) {
        let Some(close) = closing_quote(trimmed) else {
            return value;
        };
        let after = &trimmed[close + 1..];
        return match after.trim_start().starts_with('#') || after.trim().is_empty() {
            true => &trimmed[..=close],
            false => value,
        };
    }
    match value.find(" #") {
        Some(at) => &value[..at],
        None => value,
    }
}

/// Folds block lines: single newlines become spaces, blank lines paragraph breaks.
fn fold(lines: &[&str]) -> String {
    let mut out = String::new();
    for line in lines {
        if line.is_empty() {
            out.push('\n');
        } else {
            if !out.is_empty() && !out.ends_with('\n') {
                out.push(' ');
            }
            out.push_str(line);
        }
    }
    out
}

/// A flow mapping of strings written on one line (`{}`, `{a: b, "c": 'd'}`), in order.
fn flow_mapping(text: &str, number: usize) -> Result<Vec<(String, String)>, String> {
    let refused = || format!("line {number}: `metadata` must be a mapping of strings.");
    let inner = text
        .strip_prefix('{')
        .and_then(|text| text.strip_suffix('}'))
        .ok_or_else(refused)?;
    // Split at the commas outside quotes.
    let mut entries = Vec::new();
    let (mut start, mut quote, mut chars) = (0, None, inner.char_indices().peekable());
    while let Some((at, c)) = chars.next() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some('"'), '\\') => {
                chars.next();
            }
            (Some('\''), '\'') if chars.peek().is_some_and(|(_, next)| *next == '\'') => {
                chars.next();
            }
            (Some(open), c) if c == open => quote = None,
            (None, ',') => {
                entries.push(&inner[start..at]);
                start = at + 1;
            }
            (None, '{' | '[') => return Err(refused()),
            _ => {}
        }
    }
    if quote.is_some() {
        return Err(refused());
    }
    entries.push(&inner[start..]);
    let mut mapping = Vec::new();
    for entry in entries {
        let entry = entry.trim();
        if entry.is_empty() {
            continue;
        }
        // A quoted key may hold `: ` itself.
        let (key, value) = if entry.starts_with(['"', '\'']) {
            let close = closing_quote(entry).ok_or_else(refused)?;
            let value = entry[close + 1..].trim_start().strip_prefix(':').ok_or_else(refused)?;
            (&entry[..=close], value)
        } else {
            entry.split_once(':').ok_or_else(refused)?
        };
        mapping.push((unquote_key(key.trim(), number)?, scalar(value.trim(), number)?));
    }
    Ok(mapping)
}

fn scalar(value: &str, number: usize) -> Result<String, String> {
    if let Some(inner) = value.strip_prefix('\'') {
        let inner = inner
            .strip_suffix('\'')
            .ok_or_else(|| format!("line {number}: unterminated single-quoted string."))?;
        return Ok(inner.replace("''", "'"));
    }
    if let Some(inner) = value.strip_prefix('"') {
        let inner = inner
            .strip_suffix('"')
            .ok_or_else(|| format!("line {number}: unterminated double-quoted string."))?;
        let mut out = String::with_capacity(inner.len());
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            let hex = |chars: &mut std::str::Chars<'_>, digits: usize| {
                let code: String = chars.take(digits).collect();
                (code.len() == digits)
                    .then(|| u32::from_str_radix(&code, 16).ok().and_then(char::from_u32))
                    .flatten()
                    .ok_or_else(|| format!("line {number}: invalid escape in a double-quoted string."))
            };
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t' | '\t') => out.push('\t'),
                Some('r') => out.push('\r'),
                Some('0') => out.push('\0'),
                Some('a') => out.push('\u{7}'),
                Some('b') => out.push('\u{8}'),
                Some('v') => out.push('\u{b}'),
                Some('f') => out.push('\u{c}'),
                Some('e') => out.push('\u{1b}'),
                Some(' ') => out.push(' '),
                Some('N') => out.push('\u{85}'),
                Some('_') => out.push('\u{a0}'),
                Some('L') => out.push('\u{2028}'),
                Some('P') => out.push('\u{2029}'),
                Some('x') => out.push(hex(&mut chars, 2)?),
                Some('u') => {
                    let code: String = chars.by_ref().take(4).collect();
                    let unit = (code.len() == 4)
                        .then(|| u32::from_str_radix(&code, 16).ok())
                        .flatten()
                        .ok_or_else(|| format!("line {number}: invalid escape in a double-quoted string."))?;
                    // A UTF-16 surrogate pair written as two escapes (as JSON writes them) is
                    // one character.
                    let character = if (0xD800..0xDC00).contains(&unit) {
                        let mut low = chars.clone();
                        let pair: Option<u32> = (low.next() == Some('\\') && low.next() == Some('u'))
                            .then(|| u32::from_str_radix(&low.by_ref().take(4).collect::<String>(), 16).ok())
                            .flatten()
                            .filter(|low| (0xDC00..0xE000).contains(low));
                        pair.and_then(|second| {
                            chars = low;
                            char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (second - 0xDC00))
                        })
                    } else {
                        char::from_u32(unit)
                    };
                    out.push(
                        character.ok_or_else(|| format!("line {number}: invalid escape in a double-quoted string."))?,
                    );
                }
                Some('U') => out.push(hex(&mut chars, 8)?),
                Some('"') => out.push('"'),
                Some('\\') => out.push('\\'),
                Some('/') => out.push('/'),
                other => {
                    return Err(format!(
                        "line {number}: unsupported escape `\\{}` in a double-quoted string.",
                        other.map(String::from).unwrap_or_default()
                    ));
                }
            }
        }
        return Ok(out);
    }
    if value.starts_with(['[', '{', '&', '*', '!']) {
        return Err(format!(
            "line {number}: only plain, quoted and block strings are supported in SKILL.md front matter."
        ));
    }
    Ok(value.to_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    /// A quoted value of many lines is read in time linear in its length: the closing quote is
    /// looked for in what each line adds, never in all the lines again.
    #[test]
    fn a_quoted_value_over_many_lines_is_looked_at_once() {
        let parsed = parse(&format!("---\nname: \"x{}\n  y\"\n---\nbody", "\n".repeat(250_000)));
        assert!(parsed.unwrap().fields["name"].ends_with('y'));
        let unterminated = parse(&format!("---\nname: \"x{}\n---\n", "\n".repeat(250_000)));
        assert!(unterminated.is_err());
        // The incremental look agrees with the whole one, escapes across the joins included.
        for value in ["\"a\\", "\"a\\\"", "'it''", "'it'' s", "\"é\\\\", "'x'"] {
            let mut closing = Closing::of(value);
            let mut text = value.to_owned();
            for more in ["", " b", "\"", " c'", "'", " d"] {
                text.push_str(more);
                assert_eq!(closing.find(&text), closing_quote(&text), "{text:?}");
                if closing_quote(&text).is_some() {
                    break;
                }
            }
        }
    }

    #[test]
    fn reads_scalars_quotes_blocks_and_metadata() {
        let parsed = parse(
            "---\nname: refunds\ndescription: \"Process a refund: \\\"fast\\\".\"\nlicense: 'It''s MIT'\ncompatibility: >\n  Needs network\n  access.\nmetadata:\n  author: ada\n  version: \"1.0\"\nallowed-tools: Bash(git:*) Read\nunknown: kept out # a comment\n---\n\nStep one.\n\nStep two.\n",
        )
        .unwrap();
        assert_eq!(parsed.fields["name"], "refunds");
        assert_eq!(parsed.fields["description"], "Process a refund: \"fast\".");
        assert_eq!(parsed.fields["license"], "It's MIT");
        assert_eq!(parsed.fields["compatibility"], "Needs network access.");
        assert_eq!(parsed.fields["allowed-tools"], "Bash(git:*) Read");
        assert!(!parsed.fields.contains_key("unknown"), "unknown fields are skipped");
        assert_eq!(parsed.metadata["author"], "ada");
        assert_eq!(parsed.metadata["version"], "1.0");
        assert_eq!(parsed.body, "Step one.\n\nStep two.");
    }

    #[test]
    fn a_literal_block_keeps_its_lines_and_a_plain_scalar_continues() {
        let parsed = parse("---\ndescription: |\n  one\n  two\nname: long\n  name\n---\nbody").unwrap();
        assert_eq!(parsed.fields["description"], "one\ntwo");
        assert_eq!(parsed.fields["name"], "long name");
    }

    /// What the reference's YAML reads, and skills in the wild write: unknown fields holding
    /// anything, a comment after a quoted value, a quoted string over several lines, YAML's
    /// escapes, and block indicators.
    #[test]
    fn reads_third_party_front_matter_the_reference_reads() {
        let parsed = parse(concat!(
            "---\n",
            "name: \"refunds\"  # the id\n",
            "tags: [git, review]\n",
            "extra: {a: 1}\n",
            "nested:\n  - one\n  - two: [x]\n",
            "anchor: &a value\n",
            "description: \"Process a refund \\u00e9t\\x41 and\n  more\" # folded\n",
            "license: 'It''s\n  MIT'\n",
            "compatibility: |+\n  keep\n",
            "allowed-tools: >2-\n  Bash\n  Read\n",
            "keywords:\n- one\n- two\n",
            "---\nbody",
        ))
        .unwrap();
        assert_eq!(parsed.fields["name"], "refunds");
        assert_eq!(parsed.fields["description"], "Process a refund \u{e9}tA and more");
        assert_eq!(parsed.fields["license"], "It's MIT");
        assert_eq!(parsed.fields["compatibility"], "keep");
        assert_eq!(parsed.fields["allowed-tools"], "Bash Read");
        assert_eq!(parsed.fields.len(), 5, "{:?}", parsed.fields);
    }

    /// Forms published skills use that YAML reads as this format's strings: a flow mapping of
    /// metadata (empty too), a plain value over paragraphs, a literal block's own
    /// indentation, a character escaped as a UTF-16 surrogate pair.
    #[test]
    fn flow_metadata_paragraphs_indented_blocks_and_surrogate_escapes_are_read_as_yaml_reads_them() {
        let parsed = parse("---\nname: x\nmetadata: {}\n---\n").unwrap();
        assert!(parsed.metadata.is_empty());
        let parsed = parse("---\nmetadata: {author: ada, \"a: b\": 'it''s, fine', version: \"1.0\"}\n---\n").unwrap();
        assert_eq!(
            parsed.metadata.into_iter().collect::<Vec<_>>(),
            [
                ("a: b".to_owned(), "it's, fine".to_owned()),
                ("author".to_owned(), "ada".to_owned()),
                ("version".to_owned(), "1.0".to_owned()),
            ]
        );
        let parsed =
            parse("---\ndescription: First paragraph\n  continues.\n\n  Second paragraph.\nname: x\n---\n").unwrap();
        assert_eq!(
            parsed.fields["description"],
            "First paragraph continues.\nSecond paragraph."
        );
        assert_eq!(parsed.fields["name"], "x");
        let parsed = parse("---\ndescription: |\n  Steps:\n    - a\n\n  Done.\n---\n").unwrap();
        assert_eq!(parsed.fields["description"], "Steps:\n  - a\n\nDone.");
        // Other whitespace in a block's indentation is text, and never cut through.
        for odd in ['\u{a0}', '\u{3000}'] {
            let parsed = parse(&format!("---\ndescription: |\n    Steps:\n   {odd}- a\n---\n")).unwrap();
            assert_eq!(parsed.fields["description"], format!("Steps:\n{odd}- a"));
        }
        let parsed = parse("---\ndescription: \"Launch \\uD83D\\uDE80 now\"\n---\n").unwrap();
        assert_eq!(parsed.fields["description"], "Launch \u{1F680} now");
        assert!(parse("---\ndescription: \"half \\uD83D alone\"\n---\n").is_err());
    }

    #[test]
    fn a_known_field_written_as_a_list_is_refused_with_its_line() {
        assert_eq!(
            parse("---\nname: x\nallowed-tools:\n  - Bash\n  - Read\n---\n").unwrap_err(),
            "line 4: `allowed-tools` must be a string, not a list."
        );
    }

    /// What YAML reads as something other than this format's strings, or refuses, is refused
    /// with its line rather than read as something else: a value on `metadata`'s own line, a
    /// mapping nested in it or under a known field, a key written twice.
    #[test]
    fn a_mapping_where_a_string_goes_or_a_key_written_twice_is_refused_with_its_line() {
        assert_eq!(
            parse("---\nname: x\nmetadata: some-text\n---\n").unwrap_err(),
            "line 3: `metadata` must be a mapping of strings."
        );
        assert_eq!(
            parse("---\nname: x\nmetadata: {a: {b: c}}\n---\n").unwrap_err(),
            "line 3: `metadata` must be a mapping of strings."
        );
        assert_eq!(
            parse("---\nmetadata:\n  author:\n    name: ada\n---\n").unwrap_err(),
            "line 4: metadata values must be strings of one line (a nested mapping or a value continued is not read)."
        );
        assert_eq!(
            parse("---\ndescription:\n  short: x\n---\n").unwrap_err(),
            "line 3: `description` must be a string, not a mapping."
        );
        assert_eq!(
            parse("---\nname: a\ndescription: d\nname: b\n---\n").unwrap_err(),
            "line 4: `name` is written twice."
        );
        assert_eq!(
            parse("---\nmetadata:\n  a: 1\nmetadata:\n  b: 2\n---\n").unwrap_err(),
            "line 4: `metadata` is written twice."
        );
        assert_eq!(
            parse("---\nmetadata:\n  a: 1\n  a: 2\n---\n").unwrap_err(),
            "line 4: metadata `a` is written twice."
        );
        // A plain value continued over indented lines is still one string.
        let parsed = parse("---\ndescription:\n  Refunds, and\n  returns.\nmetadata:\n\ttab: yes\n---\n").unwrap();
        assert_eq!(parsed.fields["description"], "Refunds, and returns.");
        assert_eq!(parsed.metadata["tab"], "yes");
    }

    #[test]
    fn refuses_what_it_cannot_read_with_the_line() {
        assert!(parse("name: x\n---\n").unwrap_err().contains("must start"));
        assert!(parse("---\nname: x\n").unwrap_err().contains("not closed"));
        assert_eq!(
            parse("---\nname: [a, b]\n---\n").unwrap_err(),
            "line 2: only plain, quoted and block strings are supported in SKILL.md front matter."
        );
        assert_eq!(
            parse("---\nname: x\n  indented: y\nno colon here\n---\n").unwrap_err(),
            "line 4: expected `key: value`."
        );
        assert!(
            parse("---\nname: \"open\n---\n")
                .unwrap_err()
                .contains("line 2: unterminated")
        );
    }
}
