//! URLs quoted in texts (errors, records, what the model reads) without the parts where a
//! secret may sit: a token put in a URL's userinfo, query or fragment stays out of them.

/// `url` as it may be quoted: without its userinfo, query and fragment
/// (`https://u:token@host/mcp?key=k#f` reads `https://host/mcp`). For a URL given by a user,
/// valid or not: everything from its first `?` or `#` goes, and the userinfo (up to the last
/// `@` of the authority, which runs to the next `/`) after the scheme and its slashes
/// (`https://`, `https:/`, `//`), or from the start when there are none.
pub fn url_without_secrets(url: &str) -> String {
    let url = &url[..url.find(['?', '#']).unwrap_or(url.len())];
    let scheme = url
        .find(':')
        .filter(|&colon| {
            colon > 0
                && url[..colon]
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
                && url[colon + 1..].starts_with('/')
        })
        .map_or(0, |colon| colon + 1);
    let slashes = url[scheme..].len() - url[scheme..].trim_start_matches('/').len();
    let (prefix, rest) = url.split_at(scheme + slashes);
    let authority = rest.find('/').unwrap_or(rest.len());
    let host = rest[..authority].rfind('@').map_or(0, |at| at + 1);
    format!("{prefix}{}", &rest[host..])
}

/// `url` as [`url_without_secrets`] quotes it, its path cut to `/…`: a server's path may hold
/// a key of its own (`https://host/s/<key>/mcp`), which only the scheme and host never do.
pub fn url_without_path(url: &str) -> String {
    let quoted = url_without_secrets(url);
    let scheme = match quoted.find("://") {
        Some(at) => at + 3,
        None if quoted.starts_with("//") => 2,
        None => 0,
    };
    match quoted[scheme..].find('/') {
        Some(path) if scheme + path + 1 < quoted.len() => format!("{}/…", &quoted[..scheme + path]),
        _ => quoted,
    }
}

/// `text` with every URL in it quoted as [`url_without_secrets`] does (an error quoting a
/// server's URL reaches the model and the records). A URL starts at its scheme's `://` and runs
/// to a space or a quote; the punctuation that closes the sentence around it (`(…?key=k).`)
/// stays.
pub fn without_url_secrets(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let scheme = rest[..at]
            .bytes()
            .rev()
            .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
            .count();
        let start = at + 3;
        let end = rest[start..]
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`'))
            .map_or(rest.len(), |length| start + length);
        out.push_str(&rest[..start]);
        let url = &rest[start..end];
        rest = &rest[end..];
        if scheme == 0 {
            out.push_str(url);
            continue;
        }
        // The authority ends at the path, the query or the fragment; its userinfo at its last `@`.
        let authority = url.find(['/', '?', '#']).unwrap_or(url.len());
        let host = url[..authority].rfind('@').map_or(0, |at| at + 1);
        let kept = &url[host..];
        match kept.find(['?', '#']) {
            None => out.push_str(kept),
            Some(secret) => {
                out.push_str(&kept[..secret]);
                let dropped = &kept[secret..];
                let closing = dropped.trim_end_matches([')', ']', '}', ',', '.', ';', ':']);
                out.push_str(&dropped[closing.len()..]);
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_url_without_its_path_keeps_its_scheme_and_host_only() {
        assert_eq!(
            url_without_path("https://u:p@mcp.example.com/s/sk-live-1/mcp?k=v"),
            "https://mcp.example.com/…"
        );
        assert_eq!(url_without_path("https://mcp.example.com/"), "https://mcp.example.com/");
        assert_eq!(url_without_path("https://mcp.example.com"), "https://mcp.example.com");
        assert_eq!(url_without_path("/sk-live-1/mcp"), "/…");
        assert_eq!(url_without_path("https://host/s/sk live\n/mcp"), "https://host/…");
    }

    use super::*;

    #[test]
    fn urls_in_texts_lose_their_userinfo_query_and_fragment() {
        assert_eq!(
            without_url_secrets(
                "error sending request for url (https://u:pw@host:8443/mcp?token=t&x=1#frag), when send"
            ),
            "error sending request for url (https://host:8443/mcp), when send"
        );
        assert_eq!(
            without_url_secrets("see http://h/a?k=v. Then \"wss://x@y#z\" and https://ok/path/"),
            "see http://h/a. Then \"wss://y\" and https://ok/path/"
        );
        // A path may hold `@`; only the authority's userinfo goes.
        assert_eq!(without_url_secrets("http://h/@scope/pkg"), "http://h/@scope/pkg");
        assert_eq!(without_url_secrets("no url :// here ü"), "no url :// here ü");
        assert_eq!(without_url_secrets("ü://ü?ü"), "ü://ü?ü");
    }

    #[test]
    fn a_single_url_loses_its_userinfo_query_and_fragment_valid_or_not() {
        assert_eq!(
            url_without_secrets("https://u:pw@host:8443/mcp/@x?token=t#f"),
            "https://host:8443/mcp/@x"
        );
        assert_eq!(url_without_secrets("host/mcp?token=t"), "host/mcp");
        assert_eq!(url_without_secrets("u:pw@host"), "host");
        assert_eq!(url_without_secrets("host:8443/mcp"), "host:8443/mcp");
        assert_eq!(url_without_secrets("//u@host/x"), "//host/x");
        assert_eq!(url_without_secrets("https:/u:pw@host"), "https:/host");
        assert_eq!(url_without_secrets("x?token=t://host"), "x");
        assert_eq!(url_without_secrets("https://ü@ü/ü#ü"), "https://ü/ü");
        assert_eq!(url_without_secrets(""), "");
    }
}
